"""Per engine and pause mode: requests the agent sends per update, and time from the agent's
first request to the engine reporting the new version, against the stub engines
(``stub_engines.py``: the pinned route code, engine internals stubbed, a load that takes 0 s).
`agent --once` starts each run by re-confirming the step it verified before (2 requests,
not counted). So the numbers are the agent's protocol overhead (HTTP round trips, pause/resume), not a real
reload, which on a GPU is dominated by reading the checkpoint.

    PYTHONPATH=.ci-work/engines/src-... python integration/engines/bench_notify.py [--steps 5]
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_engines import Engine, Stream  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=5)
    a = p.parse_args()
    print("| engine | mode | requests per update | first request -> version reported (ms, median) | paused (ms, median) |")
    print("|---|---|---|---|---|")
    for kind, modes in (("vllm", ["keep", "wait", "abort"]), ("sglang", ["retract", "in_place", "abort"])):
        with tempfile.TemporaryDirectory() as tmp:
            e = Engine(kind, tmp)
            try:
                s = Stream(Path(tmp))
                step = 0
                s.publish(step)
                s.agent(f"{kind}={e.url}")  # warm-up: first load
                for mode in modes:
                    nreq, total, paused = [], [], []
                    for _ in range(a.steps):
                        step += 1
                        s.publish(step)
                        # in_place with running requests fails by design (flush refused): idle there.
                        e.faults(clear_calls=True, running=0 if mode == "in_place" else 2)
                        s.agent(f"{kind}={e.url},mode={mode}")
                        calls = e.state()["calls"]
                        # `agent --once` first re-confirms the step it verified last run (a
                        # version read + resume/continue); the update is from the read before
                        # the pause on.
                        i = next(i for i, c in enumerate(calls) if c["path"] in ("/pause", "/pause_generation"))
                        calls = calls[i - 1:]
                        nreq.append(len(calls))
                        total.append((calls[-1]["t"] - calls[0]["t"]) * 1e3)
                        t = {c["path"]: c["t"] for c in calls}
                        start = t.get("/pause", t.get("/pause_generation"))
                        end = t.get("/resume", t.get("/continue_generation"))
                        paused.append((end - start) * 1e3)
                    print(f"| {kind} | {mode} | {median(nreq):.0f} | {median(total):.1f} | {median(paused):.1f} |")
            finally:
                e.stop()


if __name__ == "__main__":
    main()
