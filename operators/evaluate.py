"""``evaluate``: score the published checkpoint and write the run report."""

from __future__ import annotations

from typing import Any

from airflow.sdk import BaseOperator

from operators._common import RUN_DIR_TEMPLATE, Subprocess, durable_store, load_plan, python


class EvaluateOperator(BaseOperator):
    """Evaluate the run's checkpoint on held-out data in a subprocess (torch stays out of
    the task process); push XCom ``metrics``; write ``report.json`` in the workspace.

    :param run_dir: the run's workspace (templated; default: provision's XCom).
    :param checkpoint_path: checkpoint to score (templated; default: checkpoint_sync's).
    """

    template_fields = ("run_dir", "checkpoint_path")

    def __init__(
        self,
        *,
        run_dir: str = RUN_DIR_TEMPLATE,
        checkpoint_path: str = "{{ ti.xcom_pull(task_ids='checkpoint_sync', key='checkpoint')['path'] }}",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.run_dir = run_dir
        self.checkpoint_path = checkpoint_path
        self._proc: Subprocess | None = None

    def execute(self, context) -> dict[str, Any]:
        import json
        from pathlib import Path

        from airflow.sdk.exceptions import AirflowException, AirflowFailException

        from trainflow.report import build_report, write_report

        path = self.checkpoint_path
        if not (Path(path) / "manifest.json").exists():  # the local copy went with its host
            from trainflow.checkpoint.store import hydrate
            from trainflow.spec import TrainingSpec

            plan = load_plan(self.run_dir)
            spec = TrainingSpec.from_mapping(plan["spec"])
            ref = hydrate(Path(self.run_dir), durable_store(plan), training_hash=spec.training_hash())
            if ref is None:
                raise AirflowException(f"checkpoint {path} is gone and the store has no verified copy")
            self.log.info("checkpoint %s not on this host; evaluating the store's step %d", path, ref.step)
            path = ref.path
        # The evaluation runs the workload's code: the workers' trimmed environment (none of
        # the task's secrets), as the tenant's own OS user where one is mapped.
        from trainflow.launch import envtrim, runas

        tenant = load_plan(self.run_dir)["spec"]["tenant"]
        env = {**envtrim.trimmed(), **runas.hand_over(Path(self.run_dir), tenant)}
        self._proc = Subprocess(
            [python(), "-u", "-m", "trainflow.worker.evaluate", "--run-dir", self.run_dir, "--checkpoint", path],
            log=self.log,
            env=env,
            inherit=False,
        )
        if (rc := self._proc.run()) != 0:
            from trainflow.worker.evaluate import USER_ERROR_EXIT_CODE

            if rc == USER_ERROR_EXIT_CODE:  # the workload's own error (its message is in the log)
                raise AirflowFailException("evaluation failed in the workload's code (see the log above)")
            raise AirflowException(f"evaluation exited with code {rc}")
        result = json.loads((Path(self.run_dir) / "metrics.json").read_text())
        checkpoint = context["ti"].xcom_pull(task_ids="checkpoint_sync", key="checkpoint")
        from trainflow.plots import progress_plot

        built = build_report(self.run_dir, metrics=result, checkpoint=checkpoint)
        plot = progress_plot(Path(self.run_dir))
        built["plots"] = {"progress": str(plot)} if plot else {}
        report = write_report(self.run_dir, built)
        if built["membership"]:
            context["ti"].xcom_push(key="membership", value=built["membership"])
            for m in built["membership"]:
                self.log.info(
                    "gang %s at step %s: world %s → %s, nodes %s → %s",
                    m["change"],
                    m["step"],
                    m["world_from"],
                    m["world_to"],
                    m["nodes_from"],
                    m["nodes_to"],
                )
        if built.get("goodput"):
            context["ti"].xcom_push(key="goodput", value=built["goodput"])
            for f in built["goodput"]["faults"]:
                self.log.info(
                    "fault %s at step %s: detected after %ss, training resumed after %ss from step %s, %s steps lost",
                    f["kind"],
                    f.get("step"),
                    f.get("detection_s"),
                    f.get("recovery_s"),
                    f.get("resumed_from_step"),
                    f.get("steps_lost"),
                )
        self.log.info("metrics %s; report %s", json.dumps(result["metrics"]), report)
        metrics = {
            **result["metrics"],
            "step": result["step"],
            "weights_sha256": result["weights_sha256"],
            "target_met": result.get("target", {}).get("met"),
            "report": str(report),
        }
        context["ti"].xcom_push(key="metrics", value=metrics)
        return metrics

    def on_kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
