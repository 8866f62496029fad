"""A warm torch.distributed worker group inside the edge agent (DDP or FSDP, gloo on CPU, nccl on GPU).

The group is spawned once, when the agent starts, and lives across messages and rounds: each
worker loads the factory's data once and joins the process group once. A round is a job put on every
worker's queue; all ranks train together; rank 0 answers with the full, unsharded weights.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
import multiprocessing as mp
import os
import queue
import time
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from client.config import AgentConfig
from client.dp import DPPlan
from common.procs import _die_with_parent

log = logging.getLogger(__name__)

STORE_TIMEOUT_S = 300  # how long a rank waits for the others at the rendezvous (the agent's own start-up wait)


class WorkerGroupError(RuntimeError):
    """A worker failed or died; the group is restarted before the next job."""


@dataclass(frozen=True)
class Job:
    weights: dict[str, np.ndarray]
    architecture: str
    train: dict[str, Any]  # TrainConfig fields
    request: Any = None  # client.data.DataRequest: the run's classes, image size and channels (None: the defaults)
    dp: DPPlan | None = None  # what the factory's budget allows this round (None: no DP)
    fix_model: bool = False  # --dp-fix-model: replace layers DP-SGD cannot train instead of refusing
    data_version: str = ""  # the agent's `DataSource.version`: a worker holding other images opens the folder again


class WorkerGroup:
    def __init__(self, cfg: AgentConfig, parallelism: str, world_size: int) -> None:
        if parallelism not in ("ddp", "fsdp"):
            raise ValueError(f"worker groups run ddp or fsdp, not {parallelism!r}")
        if world_size < 1:
            raise ValueError(f"--local-world-size must be >= 1, got {world_size}")
        self.cfg, self.parallelism, self.world_size = cfg, parallelism, world_size
        self.backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self.jobs = [ctx.Queue() for _ in range(self.world_size)]
        self.results = ctx.Queue()
        # The agent hosts the group's rendezvous store on a port the kernel gives it as it binds: a port chosen first and
        # bound later by rank 0 can be taken in between by anything on the host. A restarted group gets a new store.
        self.store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S), wait_for_workers=False)
        port = self.store.port
        self.procs = [
            ctx.Process(target=_worker_main, args=(rank, self.world_size, port, self.backend, self.cfg, self.parallelism, self.jobs[rank], self.results),
                        daemon=True, name=f"fedforge-{self.parallelism}-rank{rank}")
            for rank in range(self.world_size)
        ]
        for p in self.procs:
            p.start()
        ready = self._collect(timeout=STORE_TIMEOUT_S)
        log.info("%s worker group of %d ranks (%s) ready: pids %s", self.parallelism, self.world_size, self.backend, [r["pid"] for r in ready])

    def _collect(self, timeout: float) -> list[dict[str, Any]]:
        out: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(out) < self.world_size:
            try:
                rank, status, payload = self.results.get(timeout=0.5)
            except queue.Empty:
                dead = [p.name for p in self.procs if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.close(force=True)
                    raise WorkerGroupError(f"worker(s) {dead or 'all'} {'died' if dead else 'timed out'}; the group will be restarted") from None
                continue
            if status == "error":
                self.close(force=True)
                raise WorkerGroupError(f"rank {rank} failed: {payload}")
            out[rank] = payload
        return [out[r] for r in range(self.world_size)]

    def run(self, job: Job, timeout: float = 3600) -> dict[str, Any]:
        """Run one training job on every rank; return rank 0's result (weights, metrics, per-rank digests)."""
        if not all(p.is_alive() for p in self.procs):
            self.close(force=True)  # the survivors too: they belong to the dead group's rendezvous
            self._start()
        for q in self.jobs:
            q.put(job)
        results = self._collect(timeout)
        return {**results[0], "rank_digests": [r["digest"] for r in results]}

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def close(self, force: bool = False) -> None:
        if not force:
            for q in self.jobs:
                with contextlib.suppress(Exception):
                    q.put(None)
            for p in self.procs:
                p.join(10)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        self.store = None  # after the workers: they may still use it to leave the group


# ---------------------------------------------------------------------------------------------
# worker side


def _worker_main(rank: int, world_size: int, port: int, backend: str, cfg: AgentConfig, parallelism: str, jobs: Any, results: Any) -> None:
    from client.data import DataRequest, factory_data
    from common.training import set_torch_threads

    try:
        _die_with_parent()  # a killed agent takes its workers with it
        set_torch_threads(cfg.torch_threads)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))
        # nccl: bind the rank to its GPU up front (else torch guesses the device from the rank, and warns that it may hang)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                device_id=torch.device("cuda", rank) if backend == "nccl" else None)
        data = factory_data(cfg)
        results.put((rank, "ok", {"pid": os.getpid()}))
    except Exception as exc:  # noqa: BLE001 - reported to the agent, which restarts the group
        results.put((rank, "error", f"start-up: {type(exc).__name__}: {exc}"))
        return
    while True:
        job = jobs.get()
        if job is None:
            break
        try:
            if job.data_version and job.data_version != data.source.version:
                data = factory_data(cfg)  # the agent indexed its folder again (a new run): train on what it trains on
                if job.data_version != data.source.version:
                    raise RuntimeError(f"data folder {data.source.description} changed again since the agent indexed it for this run; "
                                       "the next run uses what is there then")
            train_data = data.split(job.request or DataRequest()).train
            out = run_job(job, train_data, parallelism, rank, world_size, backend)
            results.put((rank, "ok", out if rank == 0 else {"digest": out["digest"], "pid": os.getpid()}))
        except Exception as exc:
            log.exception("rank %d failed", rank)
            results.put((rank, "error", f"{type(exc).__name__}: {exc}"))
    with contextlib.suppress(Exception):
        dist.barrier()  # without it torch sometimes aborts at shutdown
        dist.destroy_process_group()


def run_job(job: Job, train_data: Any, parallelism: str, rank: int, world_size: int, backend: str) -> dict[str, Any]:
    from client.dp import check_dp_compatible
    from client.parallel import apply_activation_checkpointing, apply_ddp, apply_fsdp, full_state_dict
    from common.models import build_model, load_weights
    from common.training import TrainConfig, train

    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    channels = train_data.image_shape[0]
    model = load_weights(build_model(job.architecture, num_classes=len(train_data.classes), in_channels=channels), job.weights)
    cfg = TrainConfig(**job.train)
    if cfg.activation_checkpointing:  # the same recipe as the in-process path (client.trainer)
        apply_activation_checkpointing(model)
    if job.dp is not None:
        model = check_dp_compatible(model, fix=job.fix_model)
    model.to(device)
    t0 = time.perf_counter()
    if job.dp is None:
        wrapped = apply_ddp(model) if parallelism == "ddp" else apply_fsdp(model)
        result = train(wrapped, train_data, cfg, shard=(rank, world_size))
    else:
        wrapped = apply_ddp(model, dp=True) if parallelism == "ddp" else apply_fsdp(model)
        result = train_private_distributed(wrapped, train_data, cfg, job.dp, rank, world_size)
    weights = full_state_dict(wrapped)
    seconds = time.perf_counter() - t0
    digest = hashlib.sha256(b"".join(v.tobytes() for v in weights.values())).hexdigest()
    return {"weights": weights, "digest": digest, "pid": os.getpid(), "loss": result.loss, "accuracy": result.accuracy, "steps": result.steps, "examples": result.examples, "seconds": seconds}


def train_private_distributed(model: Any, data: Any, cfg: Any, dp: DPPlan, rank: int, world_size: int) -> Any:
    """DP-SGD across ranks: Poisson sampling on each rank's shard, batches always yielded (possibly empty)."""
    from opacus.data_loader import wrap_collate_with_empty
    from opacus.utils.uniform_sampler import DistributedUniformWithReplacementSampler
    from torch.utils.data import DataLoader
    from torch.utils.data._utils.collate import default_collate

    from client.dp import ImageSetDataset, _urandom_generator, average_by_plan, make_private, poisson_steps, run_dp_epochs
    from common.training import make_optimizer

    class AlwaysYieldSampler(DistributedUniformWithReplacementSampler):
        """Opacus' sampler skips empty batches, so ranks fall out of step; this one never skips."""

        def __iter__(self):  # type: ignore[no-untyped-def]
            g = torch.Generator().manual_seed(self.shuffle_seed + self.epoch)
            indices = torch.randperm(self.total_size, generator=g)[self.rank :: self.num_replicas]
            for _ in range(self.num_batches):
                mask = torch.rand(self.num_samples, generator=self.generator) < self.sample_rate
                yield indices[mask.nonzero(as_tuple=False).reshape(-1)].tolist()

    dataset = ImageSetDataset(data)
    sampler = AlwaysYieldSampler(total_size=len(dataset), sample_rate=dp.sample_rate, generator=_urandom_generator(),
                                 steps=poisson_steps(dp.sample_rate))  # the schedule the ledger charged
    collate = wrap_collate_with_empty(collate_fn=default_collate, sample_empty_shapes=[(0, *data.image_shape), (0,)],
                                      dtypes=[torch.float32, torch.int64])
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate)
    private_model, private_opt, criterion, private_loader = make_private(
        model, make_optimizer(model, cfg), loader, dp.noise_multiplier, dp.max_grad_norm, dp.grad_sample_mode,
        poisson_sampling=False,  # our loader already samples (Poisson, never skipping a batch)
    )
    average_by_plan(private_opt, dp, world_size)
    with warnings.catch_warnings():
        # Under Opacus' FSDP ghost clipping every forward output is a view, and FSDP2 warns on each one that an in-place op
        # on it would skip its all-gather; `run_dp_epochs` never modifies the logits in place, so the warning says nothing.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor", category=UserWarning)
        return run_dp_epochs(private_model, private_opt, criterion, private_loader, cfg, examples=len(data), step_on_empty=True,
                             on_epoch=sampler.set_epoch)
