"""Sequence models of the zoo: transformers (decoder LM, encoder, encoder-decoder, MoE, speech with CTC), torchaudio.

Each transformers model is its class built from a small config (random init, nothing downloaded; the
attention implementation is the library's default, SDPA). Text batches are 16 sequences of 256 tokens from an
8192-token vocabulary; speech batches are 8 clips of 2 s at 16 kHz (wav2vec2) or 8 x 400 frames of 80 features
(torchaudio), with CTC targets.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from zoo_models import ZooModel, ZooTask, with_bf16

__all__ = ["MODELS"]

POOL = 2
VOCAB = 8192
BATCH, LENGTH = 16, 256


def _tokens(generator: torch.Generator, length: int = LENGTH) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, length), generator=generator)


def _hf_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return model(**batch).loss


def _causal_lm(config_name: str, model_name: str, **config: Any):
    def build(generator: torch.Generator) -> ZooTask:
        import transformers

        model = getattr(transformers, model_name)(getattr(transformers, config_name)(vocab_size=VOCAB, **config))
        batches = []
        for _ in range(POOL):
            tokens = _tokens(generator)
            batches.append({"input_ids": tokens, "labels": tokens})
        return ZooTask(model, batches, _hf_loss)

    return build


def _bert(generator: torch.Generator) -> ZooTask:
    import transformers

    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=384, num_hidden_layers=6, num_attention_heads=6, intermediate_size=1536
    )
    model = transformers.BertForMaskedLM(config)
    batches = []
    for _ in range(POOL):
        tokens = _tokens(generator)
        labels = torch.where(torch.rand(tokens.shape, generator=generator) < 0.15, tokens, -100)  # 15 % masked
        batches.append({"input_ids": tokens.masked_fill(labels != -100, 4), "labels": labels})
    return ZooTask(model, batches, _hf_loss)


def _t5(generator: torch.Generator) -> ZooTask:
    import transformers

    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=384, d_kv=64, d_ff=1024, num_layers=4, num_decoder_layers=4, num_heads=6,
        decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    model = transformers.T5ForConditionalGeneration(config)
    batches = [{"input_ids": _tokens(generator), "labels": _tokens(generator, 64)} for _ in range(POOL)]
    return ZooTask(model, batches, _hf_loss)


def _wav2vec2_ctc(generator: torch.Generator) -> ZooTask:
    import transformers

    config = transformers.Wav2Vec2Config(
        vocab_size=32, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
        pad_token_id=0, ctc_loss_reduction="mean",
    )  # fmt: skip
    model = transformers.Wav2Vec2ForCTC(config)
    batches = [
        {
            "input_values": torch.randn(8, 32000, generator=generator),
            "labels": torch.randint(1, 32, (8, 40), generator=generator),
        }
        for _ in range(POOL)
    ]
    return ZooTask(model, batches, _hf_loss)


class _CTCHead(nn.Module):
    """An acoustic encoder with a linear CTC head over 32 symbols (blank = 0)."""

    def __init__(self, encoder: nn.Module, features: int, channels_first: bool) -> None:
        super().__init__()
        self.encoder, self.head, self.channels_first = encoder, nn.Linear(features, 32), channels_first

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        if self.channels_first:  # Wav2Letter: [B, F, T] in, [B, C, T'] out
            hidden = self.encoder(frames.transpose(1, 2)).transpose(1, 2)
        else:  # Conformer: [B, T, F] with lengths
            lengths = torch.full((frames.shape[0],), frames.shape[1], device=frames.device)
            hidden, _ = self.encoder(frames, lengths)
        return self.head(hidden).log_softmax(-1)  # [B, T, 32]


def _ctc_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    frames, targets = batch
    log_probs = model(frames).transpose(0, 1).float()  # [T, B, 32]
    steps, batch_size = log_probs.shape[:2]
    input_lengths = torch.full((batch_size,), steps, dtype=torch.int64)
    target_lengths = torch.full((batch_size,), targets.shape[1], dtype=torch.int64)
    return F.ctc_loss(log_probs, targets, input_lengths, target_lengths)


def _torchaudio(name: str):
    def build(generator: torch.Generator) -> ZooTask:
        import torchaudio

        if name == "conformer":
            encoder = torchaudio.models.Conformer(
                input_dim=80, num_heads=4, ffn_dim=512, num_layers=4, depthwise_conv_kernel_size=31
            )
            model = _CTCHead(encoder, 80, channels_first=False)
        else:
            model = _CTCHead(torchaudio.models.Wav2Letter(num_classes=64, input_type="mfcc", num_features=80), 64, True)
        batches = [
            (torch.randn(8, 400, 80, generator=generator), torch.randint(1, 32, (8, 30), generator=generator))
            for _ in range(POOL)
        ]
        return ZooTask(model, batches, _ctc_loss)

    return build


def _hf(name: str, build: Any, *groups: str) -> ZooModel:
    return ZooModel(name, ("transformers", *groups), ("transformers",), build)


_GPT2 = {"n_positions": 512, "n_embd": 384, "n_layer": 6, "n_head": 6, "bos_token_id": 1, "eos_token_id": 2}
_LLAMA = {
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 512,
}
_MIXTRAL = {
    "hidden_size": 384,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "output_router_logits": True,  # the router's load-balancing loss is part of the loss, as in training
    "max_position_embeddings": 512,
}

MODELS = with_bf16(
    [
        _hf("gpt2", _causal_lm("GPT2Config", "GPT2LMHeadModel", **_GPT2), "nlp"),
        _hf("bert", _bert, "nlp"),
        _hf("llama", _causal_lm("LlamaConfig", "LlamaForCausalLM", **_LLAMA), "nlp"),
        _hf("mixtral_moe", _causal_lm("MixtralConfig", "MixtralForCausalLM", **_MIXTRAL), "nlp"),
        _hf("t5", _t5, "nlp"),
        _hf("wav2vec2_ctc", _wav2vec2_ctc, "audio"),
        ZooModel("conformer_ctc", ("audio", "torchaudio"), ("torchaudio",), _torchaudio("conformer")),
        ZooModel("wav2letter_ctc", ("audio", "torchaudio"), ("torchaudio",), _torchaudio("wav2letter")),
    ],
    ["gpt2", "bert", "llama", "mixtral_moe", "t5"],
)
