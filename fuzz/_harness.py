"""What the fuzzers here share: the repository on the import path, and libFuzzer's arguments
filled in where the command line leaves them out.

A run given no corpus directory reads the seeds in `fuzz/corpus/<target>/` but writes what it
finds (new inputs, and a crash, leak or timeout as `crash-<sha1>` and the like) under
$CROWDCHAT_FUZZ_DIR/<target>/ (default `~/.cache/crowdchat/fuzz/<target>/`), so the committed
seeds stay a few small files however long it runs. A crash file replays with
`python fuzz/<harness>.py <file>`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import atheris

ROOT = Path(__file__).resolve().parent.parent
SEEDS = ROOT / "fuzz" / "corpus"
# what the seeds were made with (fuzz/make_corpus.py) and the fuzzers check them against: the
# cookie-signing key, and the fingerprint of a model of 2 layers, 3 KV heads of 4 values
SEED_KEY = "5eed" * 16
SEED_FINGERPRINT = {
    "model_id": "fuzz",
    "weights_hash": "0123abcd",
    "dtype": "bfloat16",
    "block_size": 16,
    "num_layers": 2,
    "num_kv_heads": 3,
    "head_dim": 4,
}
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def work_dir(target: str) -> Path:
    """Where runs of `target` keep the inputs they find and their crash files."""
    base = os.environ.get("CROWDCHAT_FUZZ_DIR")
    if not base:
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        base = str(cache / "crowdchat" / "fuzz")
    return Path(base) / target


def scratch(target: str) -> Path:
    """A directory of `target`'s own for the files one input makes (each input replaces them)."""
    where = work_dir(target) / "scratch"
    where.mkdir(parents=True, exist_ok=True)
    return where


def libfuzzer_args(target: str, argv: list[str]) -> list[str]:
    """`argv` plus, where it names no input, the work and seed corpus directories and where
    crash files go, and `fuzz/<target>.dict` (libFuzzer's token dictionary) where one exists."""
    args = list(argv)
    if not [a for a in args[1:] if not a.startswith("-")]:
        corpus = work_dir(target) / "corpus"
        corpus.mkdir(parents=True, exist_ok=True)
        args += [str(corpus), str(SEEDS / target)]  # the first directory gets the new inputs
        if not any(a.startswith("-artifact_prefix=") for a in args):
            args.append(f"-artifact_prefix={work_dir(target)}/")
    words = ROOT / "fuzz" / f"{target}.dict"
    if words.exists() and not any(a.startswith("-dict=") for a in args):
        args.append(f"-dict={words}")
    return args


def main(
    target: str,
    test_one_input: Callable[[bytes], None],
    mutator: Callable[[bytes, int, int], bytes] | None = None,
) -> None:
    """Fuzz `test_one_input` under libFuzzer with this process's command line (and `mutator`,
    libFuzzer's custom mutator: (data, max size, seed) -> new data, where given)."""
    extra = {"custom_mutator": mutator} if mutator else {}
    atheris.Setup(libfuzzer_args(target, sys.argv), test_one_input, **extra)
    atheris.Fuzz()
