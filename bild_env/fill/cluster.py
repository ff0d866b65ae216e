"""The fill as Ray tasks: one task per group of prompts, on any machine of a Ray cluster (``pip install -e ".[cluster]"``).

Ray schedules; nothing here does. Each task runs ``fill_prompts`` on ``FillConfig.group`` prompts
with ``cpus_per_task`` CPUs and ``gpus_per_task`` GPUs (default: one where the cluster has GPUs;
Ray then sets the task's ``CUDA_VISIBLE_DEVICES`` and the env picks ``cuda``). A Ray worker keeps
its loaded models for its next task. Every task reads and writes the bild-gym cache of the driver
(its ``BILD_ENV_CACHE``, handed to the task): on a cluster that folder must be shared storage mounted
at the same path on every machine (docs/cluster.md). A task whose worker dies (killed, out of
memory, its machine lost) is started again by Ray, up to ``max_retries`` times; its prompts whose
trees were written are then answered from disk, the rest filled again.
"""

from __future__ import annotations

from bild_env.fill import FillConfig, FillResult, fill_prompts, groups
from bild_env.paths import cache_dir

INSTALL_HINT = 'the Ray fill needs the cluster extra: pip install -e ".[cluster]"'


def import_ray():
    """The ``ray`` module, or an ImportError saying what to install."""
    try:
        import ray
    except ImportError as err:
        raise ImportError(INSTALL_HINT) from err
    return ray


def fill_on_ray(cfg: FillConfig, n_prompts: int, progress=None) -> list[FillResult]:
    """Fill prompts ``0 .. n_prompts-1`` with Ray tasks (connecting to ``cfg.ray``, or using the running Ray of this
    process); ``progress(done, total)`` is called as tasks end. Results in the order of the groups."""
    ray = import_ray()
    started = _connect(ray, cfg.ray)
    try:
        task = ray.remote(_fill_task).options(
            num_cpus=cfg.cpus_per_task, num_gpus=gpus_per_task(cfg, ray.cluster_resources()),
            max_retries=cfg.max_retries, name="bild_fill")
        root = str(cache_dir())
        pending = {task.remote(cfg, group, root): i for i, group in enumerate(groups(cfg, n_prompts))}
        results: dict[int, FillResult] = {}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            results[pending.pop(done[0])] = FillResult(**ray.get(done[0]))
            if progress is not None:
                progress(len(results), len(results) + len(pending))
        return [results[i] for i in sorted(results)]
    finally:
        if started:
            ray.shutdown()


def gpus_per_task(cfg: FillConfig, resources: dict[str, float]) -> float:
    """``cfg.gpus_per_task``, or by default one GPU per task where the cluster has GPUs (``resources``), else 0."""
    if cfg.gpus_per_task is not None:
        return cfg.gpus_per_task
    return 1.0 if resources.get("GPU", 0) > 0 else 0.0


def _connect(ray, address: str | None) -> bool:
    """Start or join Ray unless this process already has; True when this call did (and must shut it down)."""
    if ray.is_initialized():
        return False
    ray.init(address=None if address in (None, "local") else address, include_dashboard=False,
             log_to_driver=False)
    return True


def _fill_task(cfg: FillConfig, indices: list[int], cache_root: str) -> dict:
    """A Ray task's work: ``fill_prompts`` in the driver's cache folder, its result as a plain dict."""
    import ray

    result = fill_prompts(cfg, indices, cache_root=cache_root)
    result.node_ip = ray.util.get_node_ip_address()
    return result.to_dict()
