"""Train a small GPT-2-shaped byte-level language model, written in Flax, with a torch loop.

What this shows:
    A causal transformer written in Flax Linen (token and position embeddings, pre-LayerNorm
    self-attention + MLP blocks, a final LayerNorm, a head tied to the token embedding)
    whose blocks form a ``flaxside.remat_stack``: every layer is rematerialized, so a
    training step holds one carry per layer for backward instead of every attention
    matrix and MLP activation. The whole model is one ``torchside.FlaxModule``; torch owns
    its parameters and does everything else: int64 token ids straight from ``torch.tensor``
    and ``torch.randint``, ``torch.nn.functional.cross_entropy``, ``torch.optim.AdamW``
    with gradient clipping and a learning-rate schedule, ``torch.manual_seed``. The script
    prints the training loss, the held-out loss, the bytes one training call holds for
    backward next to the same model without remat (``FlaxModule.memory_report``), and a
    sample generated with a fixed-length window, so that sampling compiles one program.

    The text ships with Python, no download: the docstrings (``inspect.getdoc``) of the
    public classes, functions and methods of a fixed, sorted list of standard-library
    modules (``MODULES`` below), about 210,000 bytes. The text, and so the numbers,
    depend on the Python version; on one installation a run is deterministic. The last
    10% of the text is held out.

How to run (1.5-2 minutes on 2 CPU cores):
    pip install -e '.[examples]'
    python examples/train_lm.py
    python examples/train_lm.py --layers 8 --width 256 --steps 1000   # bigger, longer
    python examples/train_lm.py --prompt "Return the " --temperature 0.5 --sample-chars 400
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import math
import os
import time

# torch's OpenMP threads spin after each parallel region by default and would steal the
# cores XLA is about to use; passive waiting lets both runtimes share a small CPU.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

import flaxside  # noqa: E402
from torchside import FlaxModule  # noqa: E402

VOCAB = 256  # bytes: no tokenizer to build or ship, and any prompt can be encoded

MODULES = (
    "abc", "argparse", "collections", "contextlib", "csv", "dataclasses", "datetime",
    "difflib", "enum", "fractions", "functools", "heapq", "inspect", "itertools", "json",
    "logging", "pathlib", "random", "re", "shutil", "statistics", "string", "textwrap",
    "threading", "typing", "unittest", "zipfile",
)


# -- the model (Flax Linen) ----------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position ``i`` sees positions ``0..i``."""

    width: int
    heads: int
    out_init: nn.initializers.Initializer

    @nn.compact
    def __call__(self, x):
        batch, length, _ = x.shape
        qkv = nn.Dense(3 * self.width, kernel_init=nn.initializers.normal(0.02), name="qkv")(x)
        q, k, v = jnp.split(qkv.reshape(batch, length, 3 * self.heads, -1), 3, axis=2)
        h = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        return nn.Dense(self.width, kernel_init=self.out_init, name="proj")(
            h.reshape(batch, length, self.width))


class Block(nn.Module):
    """GPT-2 block: ``x + attn(LN(x))``, then ``x + MLP(LN(x))``; maps a carry to a carry.

    ``layers`` is the depth of the whole stack: as in GPT-2 the two projections back into
    the residual stream start at std ``0.02 / sqrt(2 * layers)``.
    """

    width: int
    heads: int
    layers: int

    @nn.compact
    def __call__(self, x):
        out_init = nn.initializers.normal(0.02 / math.sqrt(2 * self.layers))
        x = x + CausalSelfAttention(self.width, self.heads, out_init)(nn.LayerNorm()(x))
        h = nn.Dense(4 * self.width, kernel_init=nn.initializers.normal(0.02))(nn.LayerNorm()(x))
        return x + nn.Dense(self.width, kernel_init=out_init)(nn.gelu(h))


class GPT(nn.Module):
    """Byte ids ``(batch, length)`` -> next-byte logits ``(batch, length, VOCAB)``."""

    context: int
    width: int
    heads: int
    layers: int
    remat: bool = True

    @nn.compact
    def __call__(self, ids):
        embed = nn.Embed(VOCAB, self.width, embedding_init=nn.initializers.normal(0.02))
        pos = self.param("pos_embed", nn.initializers.normal(0.01), (self.context, self.width))
        x = embed(ids) + pos[: ids.shape[1]]
        if self.remat:
            # Every layer rematerialized: the forward keeps each layer's input (one
            # (batch, length, width) carry per layer) and the backward recomputes the layer's
            # internals. One level suffices for a few layers; a deep stack would pass
            # lengths=(a, b) to keep ~a + b carries instead of a * b.
            stack = flaxside.remat_stack(Block, self.layers, lengths=(self.layers,),
                                         width=self.width, heads=self.heads,
                                         layers=self.layers, name="blocks")
            x = stack(x)
        else:
            # The same layers under a plain scan (same parameter names and shapes): every
            # activation of every layer is kept for backward. Used only to measure that.
            scan = nn.scan(lambda block, carry, _: (block(carry), None),
                           variable_axes={"params": 0}, split_rngs={"params": True},
                           length=self.layers)
            x, _ = scan(Block(self.width, self.heads, self.layers, name="blocks"), x, None)
        return embed.attend(nn.LayerNorm()(x))  # the head is the token embedding, transposed


# -- the data (bytes of standard-library docstrings) ---------------------------------------
def _docstrings(module) -> list[str]:
    """The module's docstring and those of its public classes, functions and methods."""
    docs = [inspect.getdoc(module)]
    # vars(), not getattr(): a module's __getattr__ may warn about deprecated names.
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(obj):
            docs.append(inspect.getdoc(obj))
        elif inspect.isclass(obj):
            docs.append(inspect.getdoc(obj))
            docs += [inspect.getdoc(f) for n, f in sorted(vars(obj).items())
                     if not n.startswith("_") and inspect.isfunction(f)]
    return [d for d in docs if d]


def load_text() -> bytes:
    docs = [d for name in MODULES for d in _docstrings(importlib.import_module(name))]
    return "\n\n".join(docs).encode("utf-8")


def windows(data: torch.Tensor, starts: torch.Tensor, context: int):
    """Inputs ``data[s : s + context]`` and next-byte targets, one row per start ``s``."""
    rows = data[starts[:, None] + torch.arange(context + 1)]
    return rows[:, :-1], rows[:, 1:]


def lm_loss(model, ids, targets):
    logits = model(ids)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


@torch.no_grad()
def held_out_loss(model, data: torch.Tensor, context: int, batch: int, max_batches: int):
    """Mean loss and count of non-overlapping windows of ``data``, in full batches (one shape)."""
    model.eval()
    starts = torch.arange(0, len(data) - context - 1, context)
    n = min(len(starts) // batch, max_batches)
    losses = [lm_loss(model, *windows(data, starts[i * batch:(i + 1) * batch], context)).item()
              for i in range(n)]
    model.train()
    return sum(losses) / max(n, 1), n * batch


@torch.no_grad()
def sample(model, prompt: bytes, context: int, chars: int, temperature: float,
           generator: torch.Generator) -> bytes:
    """Generates ``chars`` bytes after ``prompt``, one model call per byte.

    Every call sees a window of exactly ``context`` ids, so one program is compiled for all
    of them (each new input shape would compile another). While the text is shorter than
    the window it sits at the start and the rest is padding: causal attention keeps
    position ``n - 1`` from seeing the padding after it, so its logits are exact. Once the
    text is longer, the window holds its last ``context`` bytes.
    """
    model.eval()
    out = list(prompt)
    for _ in range(chars):
        text = out[-context:]
        window = torch.tensor([text + [0] * (context - len(text))])
        logits = model(window)[0, len(text) - 1]
        probs = torch.softmax(logits / temperature, dim=-1)
        out.append(int(torch.multinomial(probs, 1, generator=generator)))
    model.train()
    return bytes(out[len(prompt):])


def printable(text: bytes) -> str:
    """The text, with invalid UTF-8 and control bytes (an undertrained model samples them) as
    U+FFFD, so that nothing sampled can move the terminal's cursor."""
    chars = text.decode("utf-8", errors="replace")
    return "".join(c if c.isprintable() or c in "\n\t" else "\ufffd" for c in chars)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=64, help="bytes the model sees")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=25, help="print the loss every N steps")
    parser.add_argument("--eval-batches", type=int, default=20, help="held-out batches")
    parser.add_argument("--prompt", default="Return a ")
    parser.add_argument("--sample-chars", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.width % args.heads:
        parser.error(f"--width {args.width} is not a multiple of --heads {args.heads}")

    start = time.perf_counter()
    torch.manual_seed(args.seed)
    text = load_text()
    data = torch.tensor(list(text))  # int64 ids: FlaxModule narrows them to int32 for JAX
    cut = int(0.9 * len(data))
    train, held_out = data[:cut], data[cut:]
    print(f"text: {len(text):,} bytes of docstrings from {len(MODULES)} standard-library "
          f"modules; {len(train):,} for training, {len(held_out):,} held out")

    # The whole LM is one FlaxModule (rather than a Flax trunk between a torch embedding and
    # head): the model is one Flax definition that pure JAX could run as well, the head can
    # share the embedding's matrix (Embed.attend), and only token ids and logits cross.
    size = dict(context=args.context, width=args.width, heads=args.heads, layers=args.layers)
    example = torch.zeros(args.batch, args.context, dtype=torch.long)  # int64, as the ids
    model = FlaxModule(GPT(**size), example_args=(example,), seed=args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {args.layers} layers, width {args.width}, {args.heads} heads, context "
          f"{args.context}; {n_params:,} parameters in {len(list(model.parameters()))} torch "
          f"Parameters")

    # Bytes one training call holds for backward, beyond parameters, ids and logits. This
    # compiles (without running) the programs the training steps below use, and keeps them.
    ids, _ = windows(train, torch.arange(args.batch) * args.context, args.context)
    remat = model.memory_report(ids)
    plain = FlaxModule(GPT(**size, remat=False), example_args=(example,), seed=args.seed)
    no_remat = plain.memory_report(ids)
    del plain
    print(f"held for backward by one training call (batch {args.batch}): "
          f"{remat.held_bytes / 2**20:.3f} MiB with remat_stack, "
          f"{no_remat.held_bytes / 2**20:.3f} MiB for the same model without remat "
          f"({no_remat.held_bytes / max(remat.held_bytes, 1):.1f}x more)")
    # The backward's own scratch comes on top of what is held, and remat makes it larger
    # (it recomputes each layer's activations there), so the peak shrinks less than held.
    print(f"backward scratch (XLA temp): {remat.backward_temp_bytes / 2**20:.3f} MiB with "
          f"remat_stack, {no_remat.backward_temp_bytes / 2**20:.3f} MiB without")

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr,
                                                   total_steps=args.steps, pct_start=0.1)
    print(f"training {args.steps} steps of {args.batch} windows (chance: loss "
          f"{math.log(VOCAB):.3f})")
    losses = []
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, len(train) - args.context - 1, (args.batch,))
        loss = lm_loss(model, *windows(train, starts, args.context))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if step == 1 or step % args.log_every == 0 or step == args.steps:
            print(f"step {step:4d}/{args.steps}  loss {losses[-1]:.4f}  "
                  f"({time.perf_counter() - start:5.1f} s)")

    val, n = held_out_loss(model, held_out, args.context, args.batch, args.eval_batches)
    print(f"held-out loss {val:.4f} ({val / math.log(2):.3f} bits per byte, {n} windows)")

    generator = torch.Generator().manual_seed(args.seed)
    prompt = args.prompt.encode("utf-8") or b"\n"  # an empty prompt starts a new line
    text = sample(model, prompt, args.context, args.sample_chars, args.temperature, generator)
    print(f"sample (temperature {args.temperature}):")
    print("-" * 60)
    print(printable(prompt + text))
    print("-" * 60)
    elapsed = time.perf_counter() - start
    print(f"total {elapsed:.1f} s (compiles included)")
    return {"losses": losses, "held_out": val, "held_remat": remat.held_bytes,
            "held_no_remat": no_remat.held_bytes, "sample": text, "seconds": elapsed}


if __name__ == "__main__":
    main()
