"""A lost host costs a pause, not the job: 4 simulated hosts × 1 rank train under torchring.elastic
(tests/support/_elastic_job.py) and one host is killed, paused (SIGSTOP of every process on
it) or cut off (its cable pulled) at step 3. The survivors re-form a world of 3 in process and
end with the exact weights of an epoch in which every sample was applied once.

For kill, pause and cable the rendezvous store runs on a fifth host that no fault touches: a
store outside the workers, as a job's own store server provides it. For "store" it runs where
the launch puts it by default, in rank 0's process, and rank 0's host is the one killed: the
survivors meet at the first standby store in line (torchring/elastic/standby.py).

This file is also the job (``__main__``): ``python this.py OUT VICTIM``; each rank writes
``result<rank>.json`` into OUT when it ends.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from _host_jobs import job_env, log_tails, wait_all

PORT = 29517
AT_STEP = 3
_START_S = 120.0


def _store_server(host) -> object:
    """A TCPStore server on `host`, for 600 s (killed with the hosts)."""
    code = ("import datetime, time, torch.distributed as d\n"
            f"s = d.TCPStore('0.0.0.0', {PORT}, None, True, timeout=datetime.timedelta(seconds=600), "
            "wait_for_workers=False)\n"
            "time.sleep(600)\n")
    return host.popen([sys.executable, "-c", code], cwd=host.shared)


def _wait_for(path: str, procs: list, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
            return
        time.sleep(0.1)


@pytest.mark.parametrize("fault", ["kill", "pause", "cable", "store"])
def test_a_lost_host_costs_a_pause_and_no_sample(fault: str, capsys: pytest.CaptureFixture) -> None:
    from _elastic_job import check
    from _hosts import hosts

    victim = 0 if fault == "store" else 2
    with hosts(4 if fault == "store" else 5) as hs:
        workers = hs if fault == "store" else hs[1:]
        shared = hs[0].shared
        server = None if fault == "store" else _store_server(hs[0])
        agent = {} if fault == "store" else {"TORCHELASTIC_USE_AGENT_STORE": "True"}
        env = job_env(hs, TORCHRING_TIMEOUT="5", WORLD_SIZE="4", LOCAL_WORLD_SIZE="1", MASTER_PORT=str(PORT),
                      TORCHRING_JOB_ID=f"elastic-{fault}", **agent)
        procs, logs = [], []
        for rank, h in enumerate(workers):
            logs.append(os.path.join(shared, f"log{rank}.txt"))
            with open(logs[-1], "w") as out:
                procs.append(h.popen([sys.executable, os.path.abspath(__file__), shared, str(victim)],
                                     env={**env, "RANK": str(rank), "LOCAL_RANK": "0"}, cwd=shared,
                                     stdout=out, stderr=subprocess.STDOUT))
        try:
            _wait_for(os.path.join(shared, f"victim{victim}.json"), procs, _START_S)
            assert os.path.exists(os.path.join(shared, f"victim{victim}.json")), log_tails(logs)
            lost = workers[victim]
            t_fault = time.monotonic()
            if fault in ("kill", "store"):
                lost.kill_all()
            elif fault == "pause":
                lost.signal_all(signal.SIGSTOP)
            else:
                lost.link(False)
            survivors = [p for r, p in enumerate(procs) if r != victim]
            codes = wait_all(survivors, timeout=90)
            took = time.monotonic() - t_fault
            assert codes == [0, 0, 0], f"{codes}\n{log_tails(logs)}"
            results = []
            for rank in range(4):
                path = os.path.join(shared, f"result{rank}.json")
                if rank != victim:
                    with open(path) as f:
                        results.append(json.load(f))
            assert check(results, 3) == [], f"{check(results, 3)}\n{log_tails(logs)}"
            # detection: at once for a killed host, within TORCHRING_TIMEOUT (5 s) for a silent one
            assert took < (20 if fault in ("kill", "store") else 30), f"the survivors finished {took:.1f} s after the fault"
            pause = max(r["marks"]["first_step_after"] for r in results) - t_fault  # one machine's clock
            with capsys.disabled():
                print(f"\n[elastic] host {fault}: 4 -> 3 ranks, from the fault to the survivors' first step: "
                      f"{pause:.2f} s (TORCHRING_TIMEOUT=5)")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            if server is not None:
                server.kill()


def main() -> None:
    out, victim = sys.argv[1], int(sys.argv[2])
    faulthandler.dump_traceback_later(60, exit=False)  # a hang shows its stacks in the log
    from _elastic_job import train  # tests/support is on the job's PYTHONPATH (job_env)

    rank = int(os.environ["RANK"])
    result = train(rank, victim, AT_STEP, how="wait", out_dir=out)
    with open(os.path.join(out, f"result{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
