"""The S3 tier's ranged download: a part whose body breaks off or comes up short is
fetched again, and gives up with the object, the range and the reason."""

from __future__ import annotations

import io

import pytest

from trainflow.checkpoint.s3 import S3Store
from trainflow.errors import CheckpointError

DATA = bytes(range(256)) * 64


class Body(io.BytesIO):
    def iter_chunks(self, size):
        while chunk := self.read(size):
            yield chunk


class FlakyS3:
    """``get_object`` serving ``DATA`` ranges, the first ``short`` answers cut in half."""

    def __init__(self, short: int) -> None:
        self.short, self.calls = short, 0

    def get_object(self, *, Bucket, Key, Range):
        self.calls += 1
        start, end = (int(x) for x in Range.removeprefix("bytes=").split("-"))
        body = DATA[start:end + 1]
        if self.calls <= self.short:
            body = body[: len(body) // 2]
        return {"Body": Body(body)}


def _store(s3) -> S3Store:
    return S3Store(s3, "bucket", "p", tenant="t", dag_id="d", run_id="r")


def test_a_short_body_is_fetched_again(monkeypatch, tmp_path):
    import os

    monkeypatch.setattr("time.sleep", lambda s: None)
    s3 = FlakyS3(short=2)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        assert b"".join(_store(s3)._get_range("k", 100, 1000, fd)) == DATA[100:1100]
    finally:
        os.close(fd)
    assert s3.calls == 3
    assert (tmp_path / "f").read_bytes()[100:] == DATA[100:1100]  # written at its offset


def test_a_range_that_never_arrives_whole_names_the_object_and_range(monkeypatch, tmp_path):
    monkeypatch.setattr("time.sleep", lambda s: None)
    with open(tmp_path / "f", "wb") as fh, \
            pytest.raises(CheckpointError, match=r"s3://bucket/k bytes 0\+4096: 2048 of 4096 bytes after 5 tries"):
        _store(FlakyS3(short=99))._get_range("k", 0, 4096, fh.fileno())
