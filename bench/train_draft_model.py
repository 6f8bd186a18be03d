"""Train a draft model for the demo model: a one-layer Qwen3 of the demo's vocabulary,
distilled from the demo model on the demo corpus (issue 27, item 5).

Why distillation: a drafter is judged only by how often its picks agree with the target's,
so it learns the target's next-token distribution (KL(target || drafter) on the completion
positions of fresh demo-corpus chats), not the corpus' one-hot labels. That also fits
sampled drafting, where the drafter's probabilities q should approach the target's p.

Start point: the demo model cut to its first decoder layer (its embedding, first layer,
final norm and tied head), which already agrees with the target on about half the
positions; a few minutes of distillation on two CPU cores raise that. The corpus comes from
``scripts/train_demo_model.py``'s ``CorpusGenerator`` with a seed the demo model was not
trained on (its stages used seeds 0 and 1).

The result is an HF folder (``config.json``, ``model.safetensors``, the demo's tokenizer
files, ``training_info.json``), by default under ``~/.cache/inference-engine/bench/`` (about
3 MB; not committed). ``bench/speculative.py`` calls ``ensure_draft_model`` and trains it when
missing, printing progress.

Run:  .venv/bin/python bench/train_draft_model.py [--out DIR] [--minutes 4] [--threads 2]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO = REPO_ROOT / "models" / "demo-qwen3-tiny"
DEFAULT_OUT = (Path.home() / ".cache" / "inference-engine" / "bench"
               / "demo-drafter-1layer-distilled")
# A corpus seed the demo model never saw (its two stages used 0 and 1).
CORPUS_SEED = 27


def _demo_trainer() -> Any:
    """``scripts/train_demo_model.py`` as a module (scripts/ is not a package)."""
    path = REPO_ROOT / "scripts" / "train_demo_model.py"
    spec = importlib.util.spec_from_file_location("train_demo_model", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("train_demo_model", module)
    spec.loader.exec_module(module)
    return module


def truncated_model(teacher: Any, num_layers: int) -> Any:
    """A fresh ``Qwen3ForCausalLM`` holding ``teacher``'s first ``num_layers`` layers."""
    from transformers import Qwen3ForCausalLM

    config = teacher.config.__class__.from_dict(teacher.config.to_dict())
    config.num_hidden_layers = num_layers
    config.layer_types = list(teacher.config.layer_types[:num_layers])
    student = Qwen3ForCausalLM(config).to(torch.float32)
    missing, unexpected = student.load_state_dict(teacher.state_dict(), strict=False)
    # Only the teacher's deeper layers are left over; nothing of the student is missing.
    assert not missing, missing
    return student


def encode_corpus(tokenizer: Any, num_examples: int, seed: int) -> list[tuple[list[int], int]]:
    """Fresh demo-corpus examples as (prompt + completion ids, completion start)."""
    trainer = _demo_trainer()
    examples = trainer.CorpusGenerator(seed).examples(num_examples)
    prompts = trainer.render_prompts(examples)
    out = []
    for ex, prompt in zip(examples, prompts, strict=True):
        p = tokenizer.encode(prompt, add_special_tokens=False)
        c = tokenizer.encode(ex.completion, add_special_tokens=False)
        out.append((p + c, len(p)))
    return out


def distill_loss(teacher: Any, student: Any, batch: list[tuple[list[int], int]],
                 pad_id: int) -> torch.Tensor:
    """Mean KL(teacher || student) over the completion positions of ``batch``."""
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    # mask: which positions predict a completion token (position i predicts token i + 1)
    mask = torch.zeros((len(batch), width), dtype=torch.bool)
    for row, (ids, start) in enumerate(batch):
        input_ids[row, :len(ids)] = torch.tensor(ids)
        attention_mask[row, :len(ids)] = 1
        mask[row, start - 1:len(ids) - 1] = True
    with torch.no_grad():
        hidden_t = teacher.model(input_ids=input_ids,
                                 attention_mask=attention_mask).last_hidden_state
        log_p = torch.log_softmax(teacher.lm_head(hidden_t[mask]), dim=-1)
    hidden_s = student.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    log_q = torch.log_softmax(student.lm_head(hidden_s[mask]), dim=-1)
    # log_p, log_q: [num_completion_positions, vocab]
    return (log_p.exp() * (log_p - log_q)).sum(-1).mean()


def agreement(teacher: Any, student: Any, data: list[tuple[list[int], int]]) -> float:
    """Share of completion positions where the student's argmax is the teacher's."""
    hits = total = 0
    with torch.no_grad():
        for ids, start in data:
            x = torch.tensor([ids])
            a = teacher(input_ids=x).logits[0, start - 1:-1].argmax(-1)
            b = student(input_ids=x).logits[0, start - 1:-1].argmax(-1)
            hits += int((a == b).sum())
            total += a.numel()
    return hits / max(total, 1)


def train_draft_model(out: Path = DEFAULT_OUT, *, num_layers: int = 1, minutes: float = 4.0,
                      max_steps: int = 400, batch_size: int = 8, lr: float = 1e-3,
                      num_examples: int = 3000, threads: int = 2, seed: int = CORPUS_SEED,
                      log: Any = print) -> Path:
    """Distil the demo model into a ``num_layers`` drafter; stops at ``max_steps`` or
    after ``minutes`` of training, whichever comes first. Returns ``out``."""
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)
    rng = random.Random(seed)
    tokenizer = AutoTokenizer.from_pretrained(DEMO)
    teacher = Qwen3ForCausalLM.from_pretrained(DEMO, dtype=torch.float32).eval()
    student = truncated_model(teacher, num_layers).train()
    log(f"draft model: distilling {DEMO.name} ({teacher.config.num_hidden_layers} layers) into "
        f"{num_layers} layer(s), up to {max_steps} steps or {minutes:g} min")
    data = encode_corpus(tokenizer, num_examples, seed)
    held_out, data = data[:20], data[20:]
    before = agreement(teacher, student.eval(), held_out)
    log(f"  greedy agreement with the target on held-out completions before: {before:.3f}")
    student.train()
    optimizer = torch.optim.AdamW(student.parameters(), lr=lr, betas=(0.9, 0.98),
                                  weight_decay=0.0)
    pad_id = tokenizer.pad_token_id or 0
    start = time.perf_counter()
    losses: list[float] = []
    step = 0
    while step < max_steps and time.perf_counter() - start < minutes * 60:
        # cosine decay over the step cap; the time cap may stop it earlier
        for group in optimizer.param_groups:
            group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / max_steps))
        batch = rng.sample(data, batch_size)
        loss = distill_loss(teacher, student, batch, pad_id)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
        step += 1
        if step % 10 == 0:
            log(f"  step {step:4d}  KL {sum(losses[-10:]) / 10:.4f}  "
                f"{time.perf_counter() - start:6.1f} s")
    seconds = time.perf_counter() - start
    student.eval()
    after = agreement(teacher, student, held_out)
    log(f"  greedy agreement after {step} steps ({seconds:.0f} s): {after:.3f}")
    out.mkdir(parents=True, exist_ok=True)
    student.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(DEMO / name, out / name)
    info = {"distilled_from": DEMO.name, "num_layers": num_layers, "steps": step,
            "batch_size": batch_size, "lr": lr, "corpus_seed": seed, "threads": threads,
            "train_seconds": round(seconds, 1),
            "final_kl": round(sum(losses[-20:]) / max(len(losses[-20:]), 1), 4),
            "greedy_agreement_before": round(before, 3),
            "greedy_agreement_after": round(after, 3), "torch": torch.__version__}
    (out / "training_info.json").write_text(json.dumps(info, indent=2) + "\n")
    log(f"  saved {out}")
    return out


def ensure_draft_model(out: Path = DEFAULT_OUT, log: Any = print) -> Path:
    """The trained drafter at ``out``, training it first when it is missing."""
    if (out / "training_info.json").exists() and (out / "model.safetensors").exists():
        return out
    log(f"no trained draft model at {out}: training one (a few minutes)")
    return train_draft_model(out, log=log)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--num-layers", type=int, default=1)
    p.add_argument("--minutes", type=float, default=4.0, help="training time cap")
    p.add_argument("--max-steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    train_draft_model(args.out, num_layers=args.num_layers, minutes=args.minutes,
                      max_steps=args.max_steps, batch_size=args.batch_size, lr=args.lr,
                      threads=args.threads)


if __name__ == "__main__":
    main()
