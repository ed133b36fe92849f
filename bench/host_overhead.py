"""The engine thread's own work a step, with the model taken away: what caps a fast GPU.

The real engine loop, scheduler, KV pool, sampler hand-off (the step's picks as a tensor read
back with one `tolist()`), detokenizer (the embedded model's real tokenizer) and output path run
around an instant model stand-in, `rows` requests decoding at once. A step's host time is the
engine thread's time from one call's picks to the next call (wall and thread CPU), median
over `--steps` steps once every row decodes. The replies have no stop strings, so their text is
decoded by their readers (`RequestHandle`), off the engine thread, as on a server (the relay
threads): after the timed steps, or with `--live-readers` by a thread a reply while it is
generated (every step then wakes the readers that wait, and they share the GIL with the engine
thread). Prints one JSON object a row count and, last, a summary JSON object with
`host_ms_per_step_N` for each N. `--profile` adds the engine thread's top functions by own time
(cProfile) at the largest row count. `--device-ms` adds a stand-in whose steps take that long on
a thread of their own (a GPU stream): steps/s with the loop waiting for each step's tokens
(`steps_per_s_sync_N`) and running a step ahead as it does on CUDA (`steps_per_s_ahead_N`),
alternated, and their ratios: how much of the host's work a step the overlap hides.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import json
import platform
import pstats
import queue
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import provenance  # noqa: E402
from bench.throughput import TEXT  # noqa: E402
from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.model.kv_cache import KVCache  # noqa: E402
from engine.model.loader import LoadedModel, local_tokenizer  # noqa: E402
from engine.model.plan import StepPlan  # noqa: E402
from engine.sequence import Sequence  # noqa: E402

PROMPT_TOKENS = 32
SORT = "tottime"


class InstantRunner:
    """The `StepRunner` protocol at no model cost: each sampled row's next token is the next
    one of a real text (so the detokenizer sees real words), handed back as the device
    sampler's picks are, one int64 tensor read with `tolist()`. Times the host's part of each
    step: from that hand-back to the next call (making the picks, `stand_in_ms_per_step`, is the
    stand-in's own work, as the sampling is a device's; counted until 2026-12-07)."""

    def __init__(self, reply: list[int], stop_ids: list[int]) -> None:
        self.reply = reply
        self.stop_ids = stop_ids
        self.rows = 0  # time only steps of exactly this many decodes
        # (wall, thread CPU) at a timed call, then again once its picks are made
        self.marks: list[tuple[float, ...]] = []
        self.want = 0
        self.profiler: cProfile.Profile | None = None
        self.done = False
        self.finished = threading.Event()  # set with `done`: the bench then cancels the replies

    def run(self, plan: StepPlan) -> dict[Sequence, int]:
        timed = len(plan.decodes) == self.rows and not plan.prefills and not self.done
        if timed:
            if not self.marks and self.profiler is not None:
                self.profiler.enable()
            self.marks.append((time.perf_counter(), time.thread_time()))
        sampled = plan.decodes + [s for s, n in plan.prefills if s.num_computed + n == s.num_tokens]
        n = len(self.reply)
        picks = torch.tensor([self.reply[(s.seq_id * 7 + s.num_generated) % n] for s in sampled])
        if timed:  # the stand-in's own picking (a device's work) is not the host's
            self.marks[-1] += (time.perf_counter(), time.thread_time())
            if len(self.marks) > self.want:
                self.done = True
                if self.profiler is not None:
                    self.profiler.disable()
                self.finished.set()
        return dict(zip(sampled, picks.tolist(), strict=True))


class DeviceTokens:
    """A step's picks, ready when the stand-in's "device" thread has run the step."""

    def __init__(self, picks: dict[Sequence, int], ran: threading.Event) -> None:
        self.sampled = list(picks)
        self.picks = picks
        self.ran = ran

    def tokens(self) -> list[int]:
        self.ran.wait()
        return list(self.picks.values())


class DeviceRunner(InstantRunner):
    """The stand-in with a device: each step takes `device_ms` on a thread of its own, in
    launch order, as a CUDA stream runs graph replays (a 135M-shape step on an H100: ~1-2 ms),
    without the GIL. `ahead`: behind the run-ahead protocol (engine.model.launched.RunsAhead),
    so the loop launches step N+1 before it reads step N's tokens, as it does on CUDA; else each
    step waits for its own (`run`). Records each timed step's launch time."""

    def __init__(self, reply: list[int], stop_ids: list[int], device_ms: float, ahead: bool):
        super().__init__(reply, stop_ids)
        self.device_s = device_ms / 1e3
        self.runs_ahead = ahead
        self.stream: queue.Queue[threading.Event | None] = queue.Queue()
        self.device = threading.Thread(target=self._device, daemon=True)
        self.device.start()
        self.launches: list[float] = []

    def _device(self) -> None:
        while (ran := self.stream.get()) is not None:
            time.sleep(self.device_s)
            ran.set()

    def feed(self, plan: StepPlan, prev: DeviceTokens) -> dict | None:
        return None if plan.prefills else {}

    def launch(self, plan: StepPlan, feed: dict | None = None) -> DeviceTokens:
        if len(plan.decodes) == self.rows and not plan.prefills and not self.done:
            self.launches.append(time.perf_counter())
            if len(self.launches) > self.want:
                self.done = True
                self.finished.set()
        sampled = plan.decodes + [s for s, n in plan.prefills if s.num_computed + n == s.num_tokens]
        n = len(self.reply)
        picks = {s: self.reply[(s.seq_id * 7 + s.num_generated) % n] for s in sampled}
        ran = threading.Event()
        self.stream.put(ran)
        return DeviceTokens(picks, ran)

    def run(self, plan: StepPlan) -> dict[Sequence, int]:
        step = self.launch(plan)
        return dict(zip(step.sampled, step.tokens(), strict=True))


def measure(  # noqa: PLR0913
    tokenizer,  # noqa: ANN001
    vocab: int,
    rows: int,
    steps: int,
    profile: bool,
    live: bool = False,
    device: tuple[float, bool] | None = None,
) -> dict:
    """One engine over the stand-in, `rows` requests decoding: the median host ms a step.
    `live`: a thread a reply reads it while it is generated (a server's relays), so every
    step wakes the readers that wait; else each reply is read after the timed steps.
    `device`: (ms a step, whether the loop runs ahead) for `DeviceRunner`: then steps/s."""
    reply = tokenizer.encode(TEXT, add_special_tokens=False)
    prompt = tokenizer.encode(TEXT * 2, add_special_tokens=False)
    made: list[InstantRunner] = []
    eos = tokenizer.eos_token_id

    def factory(loaded: LoadedModel, cache: KVCache, max_model_len: int = 0) -> InstantRunner:
        if device is None:
            made.append(InstantRunner(reply, [eos]))
        else:
            made.append(DeviceRunner(reply, [eos], *device))
        return made[0]

    # replies long enough for `steps` steps of every row decoding even when the rows were
    # admitted over many steps (the engine steps while the bench submits); cancelled once timed
    new = 4 * steps + 256
    per_seq_blocks = -(-(PROMPT_TOKENS + new + 16) // 16)
    per_block = 2 * 4 * 16  # K and V, 1 layer, 1 head of width 1, float32
    config = EngineConfig(
        block_size=16,
        kv_budget_mb=rows * per_seq_blocks * per_block * 1.1 / 2**20,
        max_num_seqs=max(rows, 1),
        max_num_batched_tokens=max(2048, rows * PROMPT_TOKENS),
        max_queue=rows + 1,
    )
    loaded = LoadedModel.stand_in(tokenizer, vocab, 4096, "instant")
    engine = Engine(config, loaded, runner=factory)
    runner = made[0]
    runner.rows, runner.want = rows, steps
    runner.profiler = cProfile.Profile() if profile else None
    sp = SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True)
    try:
        handles = [engine.submit(prompt[i % 50 : i % 50 + PROMPT_TOKENS], sp) for i in range(rows)]
        readers = [threading.Thread(target=h.result) for h in (handles if live else [])]
        for t in readers:
            t.start()
        runner.finished.wait(600)
        for h in handles:
            h.cancel()
        for t in readers:
            t.join()
        for h in handles:
            h.result()
    finally:
        engine.shutdown()
    if isinstance(runner, DeviceRunner):
        runner.stream.put(None)
        t = runner.launches
        return {
            "rows": rows,
            "device_ms": device[0],  # type: ignore[index]
            "run_ahead": runner.runs_ahead,
            "steps": len(t) - 1,
            "steps_per_s": round((len(t) - 1) / (t[-1] - t[0]), 1),
        }
    marks = runner.marks
    assert len(marks) > steps, f"only {len(marks)} steps of {rows} decodes"
    # from the picks' hand-back (tolist) to the next step's call of the stand-in
    wall = [(b[0] - a[2]) * 1e3 for a, b in itertools.pairwise(marks)]
    cpu = [(b[1] - a[3]) * 1e3 for a, b in itertools.pairwise(marks)]
    out = {
        "rows": rows,
        "steps": len(wall),
        "host_ms_per_step": round(statistics.median(wall), 4),
        "host_ms_per_step_p90": round(sorted(wall)[int(0.9 * len(wall))], 4),
        "engine_thread_cpu_ms_per_step": round(statistics.median(cpu), 4),
        # the stand-in's picking, not counted above (before 2026-12-07 it was)
        "stand_in_ms_per_step": round(statistics.median((m[2] - m[0]) * 1e3 for m in marks), 4),
        "text_chars": sum(len(h.text) for h in handles),
    }
    if runner.profiler is not None:
        buf = io.StringIO()
        stats = pstats.Stats(runner.profiler, stream=buf)
        stats.sort_stats(SORT).print_stats(14)
        out["profile_tottime"] = [
            line.strip() for line in buf.getvalue().splitlines() if line.strip()
        ][-16:]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", default="1,32,64,128,256", help="decoding rows, comma-separated")
    ap.add_argument("--steps", type=int, default=200, help="timed steps per row count")
    ap.add_argument("--data-dir", default=None, help="where the embedded model is converted")
    ap.add_argument("--profile", action="store_true", help="cProfile the largest row count")
    ap.add_argument(
        "--live-readers",
        action="store_true",
        help="a reader thread a reply, reading while it is generated (default: read after)",
    )
    ap.add_argument(
        "--device-ms",
        type=float,
        default=0.0,
        help="also a stand-in whose steps take this long on a device thread: steps/s with the "
        "loop waiting for each step's tokens and running a step ahead, alternated --rounds times",
    )
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the --device-ms pair")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(args.data_dir or tmp)
        tokenizer, _, _, vocab = local_tokenizer(EngineConfig(data_dir=data))
        counts = [int(r) for r in args.rows.split(",")]
        summary: dict[str, object] = {
            "bench": "host_overhead",
            **provenance(),
            "python": platform.python_version(),
            "tokenizer": type(tokenizer).__name__,
            "live_readers": args.live_readers,
        }
        for rows in counts:
            profile = args.profile and rows == counts[-1]
            row = measure(tokenizer, vocab, rows, args.steps, profile, args.live_readers)
            print(json.dumps(row), flush=True)
            summary[f"host_ms_per_step_{rows}"] = row["host_ms_per_step"]
            summary[f"cpu_ms_per_step_{rows}"] = row["engine_thread_cpu_ms_per_step"]
        if args.device_ms:
            summary["device_ms"] = args.device_ms
        for rows in counts if args.device_ms else []:
            rates: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(args.rounds):  # alternated: the box's load hits both alike
                for ahead in (False, True):
                    dev = (args.device_ms, ahead)
                    row = measure(tokenizer, vocab, rows, args.steps, False, args.live_readers, dev)
                    print(json.dumps(row), flush=True)
                    rates[ahead].append(row["steps_per_s"])
            summary[f"steps_per_s_sync_{rows}"] = rates[False]
            summary[f"steps_per_s_ahead_{rows}"] = rates[True]
            ratios = [a / b for a, b in zip(rates[True], rates[False], strict=True)]
            summary[f"ahead_over_sync_{rows}"] = [round(r, 3) for r in ratios]
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
