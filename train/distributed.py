"""The ranks of one training run: the environment a launcher sets (or a plain `python` run gets), each rank's
logging, the process group, and decisions made once on rank 0 and shared with every rank."""

from __future__ import annotations

import logging
import os
import socket
import sys
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_environment() -> tuple[int, int, int]:
    """(rank, local_rank, world_size). A plain `python` launch gets the variables a launcher would have set."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.setdefault("LOCAL_RANK", "0")
    rank, local_rank, world = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    import torch

    if torch.cuda.is_available():  # before the first collective, so each rank's objects land on its own GPU
        torch.cuda.set_device(local_rank)
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # what DeepSpeed would guess, without the warning
        if "OMP_NUM_THREADS" not in os.environ:  # ranks on one machine share its cores
            local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or world)
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(local, 1)))
    return rank, local_rank, world


def setup_logging(rank: int, run_dir: Path | None) -> None:
    """This rank's log lines, prefixed with its rank, to stderr (rank 0 from INFO, the others from WARNING); rank 0's
    also to run_dir/train.log once the run has a folder (replacing an earlier in-process run's file)."""
    fmt = logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    root = logging.getLogger()
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    if not any(getattr(h, "_r2lm", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(fmt)
        handler._r2lm = True
        root.addHandler(handler)
    for handler in [h for h in root.handlers if getattr(h, "_r2lm_file", None)]:  # an earlier in-process run's
        root.removeHandler(handler)
        handler.close()
    if run_dir is not None and rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(run_dir / "train.log")
        file_handler.setFormatter(fmt)
        file_handler._r2lm_file = str(run_dir)
        root.addHandler(file_handler)
    for noisy in ("deepspeed", "DeepSpeed", "datasets", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def init_distributed(rank: int, world: int) -> None:
    """deepspeed.init_distributed, without its leak: where every rank is on one machine, DeepSpeed's CPU backend maps
    a 64 MiB shared-memory allreduce workspace per rank (/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_
    <rank>) and never unlinks it, so each CPU run kept 64 MiB of RAM per rank until the machine rebooted. Every
    rank's init maps every rank's workspace before it returns, so after a barrier each rank unlinks the name of its
    own; the mappings stay valid until the processes end (a crash later leaves nothing behind either). (The oneCCL
    backend, not used here, makes the same workspace and is left as it is.)"""
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.comm import comm

    deepspeed.init_distributed(verbose=False)
    mapped = getattr(comm.cdb, "shm_comm_op", None) is not None and os.environ.get("LOCAL_SIZE") == str(world)
    dist.barrier()
    if mapped:  # this run's workspace: the name its backend opened (O_CREAT) for this rank
        name = "_".join(["deepspeed_allreduce_buffer", str(os.getuid()), os.environ.get("MASTER_ADDR", ""),
                         os.environ.get("MASTER_PORT", ""), str(rank)])
        (Path("/dev/shm") / name).unlink(missing_ok=True)


def rank0_decides(decide, rank: int, dist, share: bool = True):
    """decide() on rank 0 only, so the ranks of one run never disagree (on the lock, on the checkpoint): every rank
    raises its ValueError, or returns its result (share=False: only rank 0 gets it, the others None)."""
    result, error = None, None
    if rank == 0:
        try:
            result = decide()
        except ValueError as err:
            error = err
    box = [result if share else None, error]
    dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        raise box[1]
    return result if rank == 0 else box[0]
