"""`python -m training`: train the tiny fixture pairs and write them to remote_worker/fixtures/.

Each pair is a target (`target/`: config.json, bfloat16 safetensors, the byte-level tokenizer, and
`prompts.jsonl`, held-out prompts from files the training never saw) and its DFlash draft (`draft/`).
Training is seeded and counted in steps, so the same Python (its standard library is the corpus), torch and
transformers give the same fixtures; on 2 CPU cores the defaults take about 25 minutes in all.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import torch
import transformers

from remote_worker.models.loading import load_drafter, load_model
from remote_worker.models.target import TargetModel
from remote_worker.spec import DraftSpec, ModelSpec
from training.corpus import corpus, held_out_prompts, windows, write_prompts
from training.tokenizer import byte_tokenizer
from training.train import continuations, draft_values, save_draft, target_config, train_draft, train_target

FIXTURES = Path(__file__).resolve().parent.parent / "remote_worker" / "fixtures"
PAIRS = {
    "tiny_trained": ("Qwen3_5ForCausalLM", ["linear_attention"] * 3 + ["full_attention"]),
    "tiny_trained_dense": ("Qwen3ForCausalLM", ["full_attention"] * 4),
}
HIDDEN, BLOCK_SIZE, PREFIX, CONTINUATION = 128, 8, 64, 128


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def train_pair(name: str, out: Path, target_steps: int, draft_steps: int, sequences: int) -> None:
    arch, layers = PAIRS[name]
    data = corpus(held_out=False, limit_bytes=12_000_000)
    model = train_target(arch, target_config(arch, HIDDEN, layers), data, target_steps, log)
    target_dir, draft_dir = out / name / "target", out / name / "draft"
    model.to(torch.bfloat16).save_pretrained(target_dir)
    byte_tokenizer().save_pretrained(target_dir)
    write_prompts(target_dir / "prompts.jsonl", held_out_prompts(count=8, prefix_bytes=160, seed=0))
    # From here on the target is what was saved (bfloat16 weights), read back as the worker reads it.
    spec = ModelSpec(name, "pretrained", arch, "float32", "cpu", {}, str(target_dir))
    target = TargetModel(load_model(spec, seed=0))
    generator = torch.Generator().manual_seed(2)
    log(f"{name}: {sequences} greedy continuations of training prefixes")
    seqs = continuations(target.model, windows(data, PREFIX, sequences, generator), CONTINUATION)
    values = draft_values(HIDDEN, BLOCK_SIZE, target_layer_ids=[0, len(layers) - 2], target_layers=len(layers))
    draft = train_draft(target, values, seqs, PREFIX, draft_steps, log)
    save_draft(draft, values, draft_dir)
    # Read both back through the worker's loaders, as a run will.
    spec = dataclasses.replace(spec, draft=DraftSpec(source="pretrained", config={}, path=str(draft_dir)))
    load_drafter(spec, seed=0, target=target.model)
    log(f"{name}: written to {out / name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=FIXTURES)
    parser.add_argument("--target-steps", type=int, default=600)
    parser.add_argument("--draft-steps", type=int, default=300)
    parser.add_argument("--sequences", type=int, default=256)
    parser.add_argument("--only", choices=sorted(PAIRS), default=None)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    transformers.logging.set_verbosity_error()
    for name in [args.only] if args.only else list(PAIRS):
        train_pair(name, args.out, args.target_steps, args.draft_steps, args.sequences)


if __name__ == "__main__":
    main()
