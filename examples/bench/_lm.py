"""The benchmark's real-model rows: a GPT-2-shaped Transformer trained from torch.

Models: Hugging Face's ``FlaxGPT2LMHeadModule`` (and ``GPT2LMHeadModel`` as its torch
twin) when ``transformers<5`` is installed (``pip install -e '.[hf]'``), and always our own
Linen GPT-2 (``train_lm.Block``: pre-LayerNorm attention + GELU MLP, tied head) with a
torch twin written here. Same config for both: 2 layers, width 128, 4 heads, vocabulary
1024; a batch of 8 sequences of 32 int64 token ids (as a torch data loader yields them) and
as many targets; random weights, dropout off.

Contestants, one forward+backward each (timed in interleaved rounds; gradients cleared
outside the timed region):

* ``pure JAX``: ``jit(value_and_grad)`` of the loss (token cross-entropy) over the
  parameters: one fused program, the limit;
* ``pure JAX split``: the same in three jitted programs, as a bridge must split it when
  torch computes the loss: forward returning the VJP (its residuals), the loss and its
  gradient with respect to the logits, the backward;
* ``pure JAX split, dots``: the split with the forward under ``jax.checkpoint(policy=DOTS)``:
  residuals are the matmul outputs, the elementwise work is recomputed in the backward;
* ``no bridge: JAX + torch loss`` and ``no bridge: JAX dots + torch loss``: the two splits
  with torch's ``cross_entropy`` between the programs (DLPack both ways): what any bridge
  that lets torch compute the loss pays at least, without a remat policy and with the
  cheapest one here;
* ``bridge, loss in torch``: ``FlaxModule`` returns the logits, torch computes
  ``cross_entropy`` and calls ``backward`` (two programs: forward with residuals, backward);
* ``bridge, loss in torch, remat dots``: the same for the model under ``nn.remat`` with the
  ``DOTS`` policy (``Dots``), which a user writes to hold the matmul outputs only;
* ``bridge, loss inside``: the Flax module computes the loss; the scalar-loss route runs
  one fused program (NOTE [Scalar loss] in ``torchside/call/_eager.py``);
* ``torch eager``: the torch twin.

And one full AdamW training step: the bridge with ``torch.optim.AdamW`` against pure JAX
with ``optax.adamw`` in one jitted step; torch's optimizer step is timed on its own too.
"""

from __future__ import annotations

import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # this folder, and examples/ for train_lm.py
from _docs import md_table  # noqa: E402
from _measure import Contestant, race  # noqa: E402
from train_lm import Block  # noqa: E402

from torchside import FlaxModule  # noqa: E402

CONFIG = dict(layers=2, width=128, heads=4, vocab=1024, context=32, batch=8)
TARGETS = {"bridge, loss in torch": 1.25, "bridge, loss in torch, remat dots": 1.25,
           "bridge, loss inside": 1.05}
# Keeps matmul outputs, recomputes the elementwise work in the backward (fused there).
DOTS = jax.checkpoint_policies.dots_with_no_batch_dims_saveable


class OwnGPT(nn.Module):
    """GPT-2 in Linen: token and position embeddings, ``Block``s, final LN, tied head."""

    layers: int
    width: int
    heads: int
    vocab: int
    context: int

    @nn.compact
    def __call__(self, ids):
        embed = nn.Embed(self.vocab, self.width, embedding_init=nn.initializers.normal(0.02))
        pos = self.param("pos_embed", nn.initializers.normal(0.01), (self.context, self.width))
        x = embed(ids) + pos[: ids.shape[1]]
        for i in range(self.layers):
            x = Block(self.width, self.heads, self.layers, name=f"block_{i}")(x)
        return embed.attend(nn.LayerNorm()(x))


class HFLogits(nn.Module):
    """Hugging Face's Flax GPT-2 LM head module, returning the logits."""

    config: object

    @nn.compact
    def __call__(self, ids):
        from transformers.models.gpt2.modeling_flax_gpt2 import FlaxGPT2LMHeadModule

        mask = jnp.ones_like(ids)
        positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
        return FlaxGPT2LMHeadModule(self.config, name="gpt2")(
            ids, mask, positions, deterministic=True).logits


class WithLoss(nn.Module):
    """``model``'s mean token cross-entropy against ``targets``: a scalar loss inside."""

    model: nn.Module

    @nn.compact
    def __call__(self, ids, targets):
        logits = self.model(ids)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


class Dots(nn.Module):
    """``model`` under ``nn.remat`` with the ``DOTS`` policy: what a user writes to hold less.

    Its parameters are ``{"model": model's}``.
    """

    model: nn.Module

    @nn.compact
    def __call__(self, ids):
        return nn.remat(lambda mdl, x: mdl(x), policy=DOTS)(self.model, ids)


class TorchGPT(torch.nn.Module):
    """The torch twin of ``OwnGPT`` (same shapes and operations; its own random weights)."""

    def __init__(self, layers, width, heads, vocab, context):
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(vocab, width)
        self.pos = torch.nn.Parameter(torch.randn(context, width) * 0.01)
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleDict(dict(
            ln1=torch.nn.LayerNorm(width), qkv=torch.nn.Linear(width, 3 * width),
            proj=torch.nn.Linear(width, width), ln2=torch.nn.LayerNorm(width),
            up=torch.nn.Linear(width, 4 * width), down=torch.nn.Linear(4 * width, width),
        )) for _ in range(layers))
        self.ln = torch.nn.LayerNorm(width)

    def forward(self, ids):
        b, t = ids.shape
        x = self.embed(ids) + self.pos[:t]
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["ln1"](x)).view(b, t, 3, self.heads, -1).unbind(2)
            h = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), is_causal=True)
            x = x + blk["proj"](h.transpose(1, 2).reshape(b, t, -1))
            x = x + blk["down"](F.gelu(blk["up"](blk["ln2"](x)), approximate="tanh"))
        return self.ln(x) @ self.embed.weight.T


def models() -> list[tuple[str, nn.Module, object]]:
    """``(name, Linen model, torch twin)`` for each model this installation can build."""
    c = CONFIG
    out = [("own Linen GPT-2", OwnGPT(c["layers"], c["width"], c["heads"], c["vocab"],
                                      c["context"]),
            TorchGPT(c["layers"], c["width"], c["heads"], c["vocab"], c["context"]))]
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        print("    (transformers<5 not installed: Hugging Face's GPT-2 row skipped; "
              "pip install -e '.[hf]')", flush=True)
        return out
    cfg = GPT2Config(vocab_size=c["vocab"], n_positions=c["context"], n_embd=c["width"],
                     n_layer=c["layers"], n_head=c["heads"], resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    out.append(("HF FlaxGPT2LMHeadModule", HFLogits(cfg), _HFTwin(GPT2LMHeadModel(cfg))))
    return out


class _HFTwin(torch.nn.Module):
    """``GPT2LMHeadModel``, returning the logits."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids).logits


class _Contestant(Contestant):
    """A contestant made of a function: ``call`` runs one step, ``params`` are cleared."""

    def __init__(self, name, call, params):
        self.name, self.call, self.params = name, call, params


def lm_rows(size: dict) -> list[dict]:
    """Times of each contestant per model, and of the training steps."""
    c = CONFIG
    torch.manual_seed(0)
    ids = torch.randint(0, c["vocab"], (c["batch"], c["context"]))  # int64, as from a loader
    targets = torch.randint(0, c["vocab"], (c["batch"], c["context"]))
    j_ids, j_targets = (jnp.asarray(t.numpy().astype(np.int32)) for t in (ids, targets))
    rows = []
    for name, model, twin in models():
        variables = jax.jit(model.init)(jax.random.key(0), j_ids)
        logits_m = FlaxModule(model, variables=variables)
        nested = {"params": {"model": variables["params"]}}
        loss_m = FlaxModule(WithLoss(model), variables=nested)
        dots_m = FlaxModule(Dots(model), variables=nested)

        def loss_fn(params, ids, targets, model=model):
            logits = model.apply({"params": params}, ids)
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

        fused = jax.jit(jax.value_and_grad(loss_fn))
        params = jax.device_put(variables["params"])
        split_fwd = jax.jit(lambda p, ids, model=model: jax.vjp(
            lambda p: model.apply({"params": p}, ids), p))
        split_loss = jax.jit(jax.value_and_grad(
            lambda logits, t: optax.softmax_cross_entropy_with_integer_labels(logits, t).mean()))
        split_bwd = jax.jit(lambda vjp, g: vjp(g))
        dots_fwd = jax.jit(lambda p, ids, model=model: jax.vjp(jax.checkpoint(
            lambda p: model.apply({"params": p}, ids), policy=DOTS), p))

        def pure_split(p=params, fwd=split_fwd, loss=split_loss, bwd=split_bwd):
            logits, vjp = fwd(p, j_ids)
            _, g = loss(logits, j_targets)
            jax.block_until_ready(bwd(vjp, g))

        def floor(p=params, fwd=dots_fwd, bwd=split_bwd):
            """No bridge: JAX's programs, torch's loss, DLPack between them."""
            logits, vjp = fwd(p, j_ids)
            t = torch.from_dlpack(logits).requires_grad_()
            F.cross_entropy(t.reshape(-1, c["vocab"]), targets.reshape(-1)).backward()
            jax.block_until_ready(bwd(vjp, jax.dlpack.from_dlpack(t.grad)))

        def torch_loss(m=logits_m):
            F.cross_entropy(m(ids).reshape(-1, c["vocab"]), targets.reshape(-1)).backward()

        def dots_loss(m=dots_m):
            F.cross_entropy(m(ids).reshape(-1, c["vocab"]), targets.reshape(-1)).backward()

        def twin_loss(m=twin):
            F.cross_entropy(m(ids).reshape(-1, c["vocab"]), targets.reshape(-1)).backward()

        contestants = [
            _Contestant("pure JAX", lambda f=fused, p=params: jax.block_until_ready(
                f(p, j_ids, j_targets)), []),
            _Contestant("pure JAX split", pure_split, []),
            _Contestant("pure JAX split, dots", lambda f=dots_fwd: pure_split(fwd=f), []),
            _Contestant("no bridge: JAX + torch loss", lambda f=split_fwd: floor(fwd=f), []),
            _Contestant("no bridge: JAX dots + torch loss", floor, []),
            _Contestant("bridge, loss in torch", torch_loss, list(logits_m.parameters())),
            _Contestant("bridge, loss in torch, remat dots", dots_loss,
                        list(dots_m.parameters())),
            _Contestant("bridge, loss inside", lambda m=loss_m: m(ids, targets).backward(),
                        list(loss_m.parameters())),
            _Contestant("torch eager", twin_loss, list(twin.parameters())),
        ]
        # The three JAX routes compute one loss; the twin has other weights.
        with torch.no_grad():
            values = [float(fused(params, j_ids, j_targets)[0]),
                      float(F.cross_entropy(logits_m(ids).reshape(-1, c["vocab"]),
                                            targets.reshape(-1))),
                      float(loss_m(ids, targets)),
                      float(F.cross_entropy(dots_m(ids).reshape(-1, c["vocab"]),
                                            targets.reshape(-1)))]
        times, rounds = race(contestants, budget=size["budget"] * 2,
                             min_repeats=size["min_repeats"], warmup=size["warmup"],
                             label=name)
        step = train_steps(model, loss_m, params, ids, targets, j_ids, j_targets, size)
        held = {"plain": logits_m.memory_report(ids).held_bytes,
                "remat dots": dots_m.memory_report(ids).held_bytes}
        rows.append(dict(name=name, times=times, rounds=rounds, steps=step, held=held,
                         mismatch=max(abs(v - values[0]) for v in values) / abs(values[0])))
    return rows


def train_steps(model, loss_m, params, ids, targets, j_ids, j_targets, size) -> dict:
    """One AdamW step: the bridge (loss inside, ``torch.optim.AdamW``) and JAX + optax."""
    opt = torch.optim.AdamW(loss_m.parameters(), lr=1e-3)
    tx = optax.adamw(1e-3)

    def loss_fn(params, ids, targets):
        logits = model.apply({"params": params}, ids)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    @jax.jit
    def jax_step(params, state, ids, targets):
        loss, grads = jax.value_and_grad(loss_fn)(params, ids, targets)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    box = [jax.tree.map(jnp.copy, params), None]
    box[1] = tx.init(box[0])

    def pure_step():
        box[0], box[1], loss = jax_step(box[0], box[1], j_ids, j_targets)
        jax.block_until_ready(loss)

    def bridge_step():
        opt.zero_grad(set_to_none=True)
        loss_m(ids, targets).backward()
        opt.step()

    loss_m(ids, targets).backward()  # gradients for the optimizer-only contestant

    contestants = [_Contestant("pure JAX + optax", pure_step, []),
                   _Contestant("bridge + torch AdamW", bridge_step, []),
                   _Contestant("torch AdamW.step alone", opt.step, [])]
    times, _ = race(contestants, budget=size["budget"], min_repeats=size["min_repeats"],
                    warmup=size["warmup"], label=f"{type(model).__name__} training step")
    return times


def print_lm(rows: list[dict], fmt_time) -> tuple[list[list[str]], str]:
    """Prints the real-model table.

    Returns:
        The target rows for the summary, and the printed tables as markdown.
    """
    targets, md = [], []
    for r in rows:
        t = r["times"]
        base = t["pure JAX"]
        title = (f"{r['name']} (2 layers, width 128, 4 heads, vocab 1024, batch 8 x 32; "
                 f"{r['rounds']} rounds; losses agree to {r['mismatch']:.1e})")
        print(f"\n{title}")
        for name, sec in t.items():
            print(f"  {name:<34} {fmt_time(sec):>10}  {sec / base:5.2f}x pure JAX")
        s = r["steps"]
        step = (f"training step: pure JAX + optax {fmt_time(s['pure JAX + optax'])}, bridge + "
                f"torch AdamW {fmt_time(s['bridge + torch AdamW'])} "
                f"({s['bridge + torch AdamW'] / s['pure JAX + optax']:.2f}x), of which "
                f"AdamW.step alone {fmt_time(s['torch AdamW.step alone'])}")
        print(f"  {step}")
        h = r["held"]
        held = (f"held for backward with the loss in torch: {h['plain'] / 2**20:.2f} MiB, "
                f"{h['remat dots'] / 2**20:.2f} MiB under remat dots")
        print(f"  {held}")
        md += [f"### {title}", "",
               md_table(["contestant", "forward+backward", "vs pure JAX"],
                        [[name, fmt_time(sec), f"{sec / base:.2f}x"] for name, sec in t.items()]),
               "", f"- {step[0].upper()}{step[1:]}.", f"- {held[0].upper()}{held[1:]}.", ""]
        for name, limit in TARGETS.items():
            ratio = t[name] / base
            targets.append([f"{r['name']}: {name} <= {limit}x pure JAX fused",
                            f"{fmt_time(t[name])} vs {fmt_time(base)}", f"{ratio:.2f}x",
                            "PASS" if ratio <= limit else "MISS"])
        targets.append([f"{r['name']}: the JAX routes compute the same loss",
                        "max |loss - pure JAX| / |loss|", f"{r['mismatch']:.1e}",
                        "PASS" if r["mismatch"] <= 1e-5 else "MISS"])
    return targets, "\n".join(md)
