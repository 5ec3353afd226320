"""Ranks of a torch.distributed world spawned on this machine for the tests: every rank runs
worker(rank, world_size, port, results) in its own process (start method 'spawn', one OpenMP
thread each) and puts (rank, report) on `results`; the parent collects the reports within a
deadline and kills what is left, so a broken world fails its tests instead of hanging."""

import os
import queue
import socket
import time


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(worker, world_size, deadline_seconds):
    """{rank: report} of one world; a rank that reports nothing within the deadline gets
    {"world": message}."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
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
