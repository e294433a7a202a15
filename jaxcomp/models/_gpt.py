"""A GPT-style decoder-only language model (pre-LayerNorm, learned positions)."""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax.numpy as jnp

from jaxcomp.models import _norm
from jaxcomp.models import _staged


class Embed(nn.Module):
    """Token embedding plus learned position embedding."""

    vocab_size: int
    seq_len: int
    dim: int

    @nn.compact
    def __call__(self, tokens, train: bool = False):
        del train
        init = nn.initializers.normal(0.02)
        tok = nn.Embed(self.vocab_size, self.dim, embedding_init=init, name="token")(tokens)
        pos = self.param("position", init, (self.seq_len, self.dim))
        return tok + pos[: tokens.shape[1]].astype(tok.dtype)


class DecoderBlock(nn.Module):
    """``x + Attn(LN(x))`` then ``x + MLP(LN(x))``, causal, GPT-2 layout."""

    dim: int
    num_heads: int
    mlp_ratio: int = 4

    @nn.compact
    def __call__(self, x, train: bool = False):
        del train
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        h = _norm.layer_norm(name="ln1")(x)
        h = nn.MultiHeadDotProductAttention(
            num_heads=self.num_heads, qkv_features=self.dim, name="attn"
        )(h, h, mask=mask)
        x = x + h
        h = _norm.layer_norm(name="ln2")(x)
        h = nn.Dense(self.mlp_ratio * self.dim, name="fc_in")(h)
        h = nn.Dense(self.dim, name="fc_out")(nn.gelu(h))
        return x + h


class LMHead(nn.Module):
    """Final LayerNorm and the vocabulary projection."""

    vocab_size: int

    @nn.compact
    def __call__(self, x, train: bool = False):
        del train
        x = _norm.layer_norm(name="ln_f")(x)
        return nn.Dense(self.vocab_size, use_bias=False, name="unembed")(x)


def gpt(
    vocab_size: int = 256,
    seq_len: int = 128,
    *,
    dim: int = 256,
    num_blocks: int = 12,
    num_heads: int = 4,
    cuts: Sequence[str] | None = None,
) -> _staged.StagedModel:
    """A GPT-2-style decoder LM: ``embed, block0 ... block{N-1}, head``.

    Paper 1 cuts GPT-2's 12 blocks after blocks 2, 5 and 8 (0-indexed) into 4 stages of three
    blocks; that is the default for 12 blocks. The activations crossing each cut are
    ``(seq_len, dim)`` per sample.

    Args:
      vocab_size: tokens (256 for byte-level text).
      seq_len: context length (the position table's size).
      dim: model width (GPT-2 small: 768).
      num_blocks: decoder blocks.
      num_heads: attention heads.
      cuts: segment names to cut after (default for 12 blocks: ``block2, block5, block8``;
        otherwise none).

    References:
      Radford et al., `Language Models are Unsupervised Multitask Learners`, 2019.
    """
    if dim % num_heads:
        raise ValueError(f"dim ({dim}) must be divisible by num_heads ({num_heads}).")
    segments = [("embed", Embed(vocab_size, seq_len, dim))]
    segments += [(f"block{i}", DecoderBlock(dim, num_heads)) for i in range(num_blocks)]
    segments.append(("head", LMHead(vocab_size)))
    default = ("block2", "block5", "block8") if num_blocks == 12 else ()
    return _staged.make_staged(
        "gpt",
        segments,
        cuts,
        default,
        input_shape=(seq_len,),
        input_dtype=jnp.int32,
        num_outputs=vocab_size,
        task="language_model",
    )
