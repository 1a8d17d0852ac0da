"""`node prepare-data`, `node export`, `node generate`: a corpus in, a Hugging Face model out
(docs/model.md). Kept apart from node/cli/__init__.py, which holds the swarm commands."""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

from node.cli.flags import add_swarm_access

logger = logging.getLogger("node")


def add_data_commands(commands: Any) -> None:
    """prepare-data, export, generate: a corpus in, a Hugging Face model out (docs/model.md)."""
    from node.model.corpus import DEFAULT_VAL_FRACTION, MAX_VAL_FRACTION
    from node.model.corpus_inputs import DEFAULT_SUFFIXES

    prepare = commands.add_parser("prepare-data", help="train a BPE tokenizer on a corpus and write token files")
    prepare.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="UTF-8 text files, source trees (their files with --suffix, tests left out) or wheels' text "
        "modules (WHEEL.whl, or WHEEL.whl:MODULE for one): node/model/corpus_inputs.py",
    )
    prepare.add_argument(
        "--suffix",
        dest="suffixes",
        action="append",
        metavar="SUFFIX",
        help=f"file suffix read from a source tree, repeatable (default: {' '.join(DEFAULT_SUFFIXES)})",
    )
    prepare.add_argument("--out", required=True, metavar="DIR", help="directory for tokenizer.json, train.bin, val.bin")
    prepare.add_argument("--vocab-size", type=int, required=True, help="tokens of the byte-level BPE (>= 257)")
    prepare.add_argument(
        "--val-fraction",
        type=float,
        default=DEFAULT_VAL_FRACTION,
        help=f"tail of every file held out in val.bin (0..{MAX_VAL_FRACTION}; default {DEFAULT_VAL_FRACTION})",
    )
    prepare.add_argument("--force", action="store_true", help="replace prepared data already in --out")

    export = commands.add_parser("export", help="write the swarm's current model as a Hugging Face checkpoint")
    add_swarm_access(export)
    export.add_argument("--out", required=True, metavar="DIR", help="checkpoint directory")
    export.add_argument(
        "--data", dest="data_path", metavar="DIR", help="the swarm's prepared data: its tokenizer goes into the export"
    )
    export.add_argument("--timeout", type=float, default=60.0, help="seconds any one message of a download may take")

    generate = commands.add_parser("generate", help="continue a prompt with an exported model")
    generate.add_argument("--model", required=True, metavar="DIR", help="a directory `node export` wrote")
    generate.add_argument("--prompt", required=True, help="text (token ids separated by spaces without a tokenizer)")
    generate.add_argument("--max-new-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above: sampling")
    generate.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    generate.add_argument("--seed", type=int, default=0, help="sampling seed")


def cmd_prepare_data(args: argparse.Namespace) -> int:
    from node.model.corpus import PreparedDataError, prepare_corpus
    from node.model.corpus_inputs import DEFAULT_SUFFIXES, expand_inputs

    start = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="pipeswarm-corpus-") as staging:
            inputs = expand_inputs(args.inputs, Path(staging), tuple(args.suffixes or DEFAULT_SUFFIXES))
            size = sum(f.stat().st_size for f in inputs.files if f.is_file())
            prepared = prepare_corpus(inputs.files, args.out, args.vocab_size, args.val_fraction, force=args.force)
    except (PreparedDataError, OSError) as e:  # OSError: --out cannot be written
        logger.error(f"cannot prepare data: {e}")
        return 2
    except KeyboardInterrupt:  # meta.json comes last: what was written is never read
        logger.error(f"interrupted: {args.out} holds no usable prepared data")
        return 130
    seconds = time.monotonic() - start
    skipped = f" ({inputs.skipped} empty or non-UTF-8 files of the trees left out)" if inputs.skipped else ""
    print(
        f"wrote {prepared.directory}: {prepared.train_tokens:,} train + {prepared.val_tokens:,} val tokens "
        f"({prepared.dtype}), vocabulary {prepared.vocab_size:,}, tokenizer {prepared.tokenizer_hash}; "
        f"{len(inputs.files):,} files, {size / 1e6:.1f} MB in {seconds:.1f} s "
        f"({size / 1e6 / max(seconds, 1e-9):.2f} MB/s){skipped}",
        flush=True,
    )
    print(f"start a swarm on it with: node bootstrap --data {prepared.directory} (stage-0 peers: node join --data DIR)")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from node.model.corpus import PreparedDataError, load_prepared
    from node.model.hf import ExportError, MissingExtra, require_transformers, write_checkpoint
    from node.monitor.export import ExportRefused, collect_stages, describe
    from node.p2p.swarm_key import load_swarm_key
    from node.runtime.byte_progress import ByteProgress
    from node.server import daemon

    try:
        require_transformers()
        prepared = load_prepared(args.data_path) if args.data_path is not None else None
    except (MissingExtra, PreparedDataError) as e:
        logger.error(f"cannot export: {e}")
        return 2
    swarm_key = load_swarm_key(args.swarm_key_path)  # SwarmKeyError: one line in main()
    collected = []

    async def collect() -> int:
        try:
            # a byte bar per stage on a terminal, log lines otherwise
            with ByteProgress() as progress:
                collected.append(
                    await collect_stages(
                        args.initial_peers,
                        args.swarm_id,
                        args.swarm_founder,
                        swarm_key,
                        timeout=args.timeout,
                        progress=progress,
                    )
                )
        except ExportRefused as e:
            logger.error(f"cannot export: {e}")
            return 5
        return 0

    code = daemon.run(collect())
    if code != 0:
        return code
    result = collected[0]
    expected = result.config.data.tokenizer_hash
    if prepared is not None and prepared.tokenizer_hash != expected:
        logger.error(
            f"cannot export: {args.data_path} has tokenizer {prepared.tokenizer_hash}, the swarm trains with "
            f"{expected or 'no prepared tokenizer'}"
        )
        return 2
    if prepared is None and expected:
        logger.warning(f"the swarm trains with tokenizer {expected}: pass --data DIR to include it in the export")
    try:
        out = write_checkpoint(
            result.config, result.stages, args.out, prepared.tokenizer_path if prepared else None, result.provenance
        )
    except ExportError as e:
        logger.error(f"cannot export: {e}")
        return 2
    print(f"exported swarm {result.config.swarm_id} to {out}:\n{describe(result)}", flush=True)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from node.model.hf import ExportError, MissingExtra, generate

    try:
        text = generate(args.model, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed)
    except (MissingExtra, ExportError) as e:
        logger.error(f"cannot generate: {e}")
        return 2
    print(text, flush=True)
    return 0
