"""A tiny Qwen3-MoE with random weights and a locally trained tokenizer, saved for vLLM and HF.

Nothing is downloaded: the tokenizer is a byte-level BPE trained with ``tokenizers`` on synthetic
text, the model a ``Qwen3MoeConfig`` with random weights. Sizes respect vLLM's CPU attention
(head_dim 32 is one of its supported head sizes). Router weights are widened from their near-zero
init so top-k expert choices are clear (replaying other experts changes the output visibly), and
the LM head so next-token distributions are peaked (``LOGIT_SCALE``).

``build_tiny_moe(path)`` writes ``config.json``, the safetensors weights and the tokenizer files
into ``path`` once (built aside and renamed into place; a stamp file marks a finished build) and
returns ``path``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

VERSION = 2
# Random weights give a near-uniform next-token distribution (entropy ~ log V); a wider LM head
# makes it peaked like a trained model's, so top-p kept sets vary from 1 id to dozens.
LOGIT_SCALE = 48.0
VOCAB = 1024
TOKENIZER_VOCAB = 1000  # < VOCAB: the model has spare (never produced by the tokenizer) rows
SPECIAL = ("<|pad|>", "<|bos|>", "<|eos|>")
_STAMP = "rollfeed-build.json"  # written last: a directory without it is not a finished build


def moe_config_kwargs(**overrides: Any) -> dict[str, Any]:
    """Keyword arguments of the tiny ``Qwen3MoeConfig`` (2 layers, 8 experts, top-2)."""
    kwargs: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    kwargs.update(overrides)
    return kwargs


def synthetic_corpus(lines: int = 2000, seed: int = 0) -> list[str]:
    """Deterministic pseudo-text: sentences of words built from a fixed syllable set."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    words = ["".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(400)]
    return [
        " ".join(rng.choices(words, k=rng.randint(4, 14))).capitalize() + "." for _ in range(lines)
    ]


def train_tokenizer() -> Any:
    """A ``PreTrainedTokenizerFast`` (byte-level BPE, ``TOKENIZER_VOCAB`` ids) trained here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=list(SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(synthetic_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=SPECIAL[0], bos_token=SPECIAL[1], eos_token=SPECIAL[2]
    )


def tiny_moe_model(
    seed: int = 0, *, logit_scale: float = LOGIT_SCALE, **overrides: Any
) -> torch.nn.Module:
    """The tiny ``Qwen3MoeForCausalLM`` in float32, eval mode, widened router and LM head."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**moe_config_kwargs(**overrides)))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("gate.weight"):
                param.normal_(0.0, 1.0)
        model.lm_head.weight.mul_(logit_scale)
    return model.float().eval()


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "rollfeed"


def build_tiny_moe(path: str | os.PathLike[str] | None = None, *, seed: int = 0) -> Path:
    """Build (once) and return the directory holding the tiny model and its tokenizer.

    The build goes into a private temporary directory beside ``path`` that is renamed to ``path``
    when complete, so a concurrent demo never sees (or loads) a half-written model: it either
    finds the finished directory or builds its own and keeps whichever landed first.
    """
    out = Path(path) if path is not None else default_cache_dir() / f"tiny-qwen3moe-v{VERSION}"
    want = {"version": VERSION, "seed": seed}
    if _is_built(out, want):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    try:
        train_tokenizer().save_pretrained(tmp)
        tiny_moe_model(seed).save_pretrained(tmp)
        (tmp / _STAMP).write_text(json.dumps(want))
        _install(tmp, out, want)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when it was renamed into place
    logger.info("built the tiny MoE into %s", out)
    return out


def _is_built(out: Path, want: dict) -> bool:
    try:
        return json.loads((out / _STAMP).read_text()) == want
    except (OSError, ValueError):
        return False


def _install(tmp: Path, out: Path, want: dict) -> None:
    """Rename the finished build ``tmp`` to ``out``; an unfinished or other build there is moved
    aside first, a finished one that another process installed meanwhile is kept."""
    for _ in range(3):
        try:
            os.rename(tmp, out)
            return
        except OSError as err:
            if err.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR):
                raise
        if _is_built(out, want):
            return
        stale = Path(tempfile.mkdtemp(prefix=f".{out.name}.stale-", dir=out.parent))
        with contextlib.suppress(FileNotFoundError):  # someone else moved it aside already
            os.rename(out, stale / "old")
        shutil.rmtree(stale, ignore_errors=True)
    raise OSError(f"could not install the tiny model build at {out}: it keeps being replaced")


@torch.no_grad()
def hf_routing(model: torch.nn.Module, token_ids: np.ndarray | list[int]) -> np.ndarray:
    """``[T, layers, top_k]`` expert ids an HF forward of ``token_ids`` routes each input to.

    Row ``t`` is the routing computed with token ``t`` as the input (what an engine records).
    Ids of one row are in descending router weight.
    """
    ids = torch.as_tensor(np.asarray(token_ids), dtype=torch.long).reshape(1, -1)
    out = model(input_ids=ids, output_router_logits=True)
    k = model.config.num_experts_per_tok
    rows = [r.reshape(ids.shape[1], -1).topk(k, dim=-1).indices for r in out.router_logits]
    return torch.stack(rows, dim=1).numpy()
