"""``checkpoint_sync``: make the newest verified checkpoint durable and publish it."""

from __future__ import annotations

from typing import Any

from airflow.sdk import BaseOperator

from operators._common import RUN_DIR_TEMPLATE, durable_store, load_plan


class CheckpointSyncOperator(BaseOperator):
    """Verify the run's newest checkpoint, copy it to the durable store, prune to keep K.

    Pushes the pointer as XCom ``checkpoint`` (and keeps it in ``task_state_store``) and
    emits an event on each outlet asset with the pointer as ``extra``, so other DAGs can
    be scheduled on new checkpoints.

    :param run_dir: the run's workspace (templated; default: provision's XCom).
    """

    template_fields = ("run_dir",)

    def __init__(self, *, run_dir: str = RUN_DIR_TEMPLATE, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.run_dir = run_dir

    def execute(self, context) -> dict[str, Any]:
        from pathlib import Path

        from airflow.sdk.exceptions import AirflowException

        from trainflow.checkpoint import manifest
        from trainflow.spec import TrainingSpec

        run_dir = Path(self.run_dir)
        plan = load_plan(run_dir)
        spec = TrainingSpec.from_mapping(plan["spec"])
        ref = manifest.newest_verified(
            run_dir / "checkpoints",
            training_hash=spec.training_hash(),
            world_size=None if spec.elastic else spec.world_size,
        )
        if ref is None:
            raise AirflowException(f"no verified checkpoint under {run_dir / 'checkpoints'}")
        manifest.prune(run_dir / "checkpoints", spec.keep_last)
        uri = Path(ref.path).as_uri()
        if (store := durable_store(plan)) is not None:
            done = store.publish(ref, spec.keep_last)
            uri = done["uri"]
            if done.get("seconds"):
                self.log.info(
                    "uploaded %d bytes in %.2fs (%.0f MB/s)",
                    done["bytes"],
                    done["seconds"],
                    done["bytes"] / 1e6 / done["seconds"],
                )
        pointer = {
            "step": ref.step,
            "uri": uri,
            "path": ref.path,
            "manifest_sha256": ref.manifest_sha256,
            "bytes": ref.bytes,
            "world_size": ref.world_size,
            "verified": True,
        }
        self.log.info("checkpoint step %d verified and published: %s", ref.step, pointer["uri"])
        if (store := context.get("task_state_store")) is not None:
            store.set("checkpoint", pointer)
        context["ti"].xcom_push(key="checkpoint", value=pointer)
        for outlet in self.outlets:
            context["outlet_events"][outlet].extra = {**pointer, "dag_id": plan["dag_id"], "run_id": plan["run_id"]}
        return pointer
