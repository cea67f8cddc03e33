from __future__ import annotations

import logging

from trainflow.tracebacks import TracebackLevels

OUTPUT = """\
[rank 1] step 40 loss 0.31
[rank1]: Traceback (most recent call last):
[rank1]:   File "/x/train.py", line 10, in <module>
[rank1]:     main()
[rank1]:     ^^^^^^
[rank1]: ValueError: injected user bug at step 40
[rank 0] waiting for the gang
Traceback (most recent call last):
  File "a.py", line 1, in f
KeyError: 'x'

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "a.py", line 3, in g
RuntimeError: boom
torch elastic: restarting workers"""


def test_the_lines_of_a_traceback_and_only_those_are_errors():
    levels = TracebackLevels()
    marks = [levels.level(line) == logging.ERROR for line in OUTPUT.splitlines()]
    assert marks == [
        False,
        True,
        True,
        True,
        True,
        True,
        False,
        True,
        True,
        True,
        False,
        True,
        True,
        True,
        True,
        True,
        False,
    ]
