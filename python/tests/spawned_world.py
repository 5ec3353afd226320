"""Ranks of a torch.distributed world spawned on this machine for the tests: every rank runs in
its own process (start method 'forkserver', one OpenMP and torch thread each), joins a gloo
process group on 127.0.0.1, fills a report dict with checks(rank, world_size, report) and puts
(rank, report) on a queue; the parent collects the reports within a deadline and kills what is
left, so a broken world fails its tests instead of hanging. The fork server, started by the
first world with OMP_NUM_THREADS=1, imports torch and poslsh once and forks every rank from
there: a rank starts without importing them again (about 3 s of CPU each), and without any
thread or process group of the parent."""

import datetime
import functools
import os
import queue
import socket
import time
import traceback


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_rank(checks, gloo_timeout, rank, world_size, port, results):
    """One rank: the gloo group (every wait bounded by gloo_timeout seconds), checks(rank,
    world_size, report), a barrier and the group's end; an exception outside the checks is
    reported as report["world"]."""
    import torch
    import torch.distributed as dist

    report = {}
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=gloo_timeout))
        checks(rank, world_size, report)
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 -- reported to the parent
        report["world"] = traceback.format_exc()
    results.put((rank, report))


def run_world(checks, world_size, deadline_seconds, gloo_timeout):
    """{rank: report} of one world whose ranks run checks(rank, world_size, report) (a function
    at module level, so that the spawned processes can import it); a rank that reports nothing
    within the deadline gets {"world": message}."""
    import torch.multiprocessing as mp

    worker = functools.partial(_gloo_rank, checks, gloo_timeout)

    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", "poslsh.distributed"])
    results = context.Queue()
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        port = free_port()
        processes = [context.Process(target=worker, args=(rank, world_size, port, results), daemon=True)
                     for rank in range(world_size)]
        for process in processes:
            process.start()
    finally:
        if saved is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    reports, deadline = {}, time.monotonic() + deadline_seconds
    try:
        while len(reports) < world_size:
            try:
                rank, report = results.get(timeout=max(0.1, deadline - time.monotonic()))
                reports[rank] = report
            except queue.Empty:
                break
    finally:
        for process in processes:
            process.join(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            if process.is_alive():
                process.kill()
                process.join(timeout=5.0)
    for rank in range(world_size):
        reports.setdefault(rank, {"world": f"rank {rank} reported nothing within {deadline_seconds} s"})
    return reports
