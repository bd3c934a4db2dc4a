"""Tiny models and a tiny local model directory (tiny model + word-level tokenizer) for eval tests."""

import random

import pytest
import torch

from lowbit.models.tiny import TINY_WORDS, tiny_model, tiny_tokenizer


def _random_windows(vocab: int, n: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def random_windows():
    """random_windows(vocab, n, length, seed=1) -> int64 [n, length]."""
    return _random_windows


@pytest.fixture(scope="session")
def tiny_smollm():
    model, config = tiny_model("smollm2-135m", vocab_size=99, seed=0)
    return model, config


@pytest.fixture(scope="session")
def tiny_gemma():
    model, config = tiny_model("gemma3-270m", vocab_size=99, seed=0)
    return model, config


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A local HF model directory: 2-layer smollm2 geometry, vocab 32, word-level tokenizer."""
    d = tmp_path_factory.mktemp("tiny_smollm")
    model, _ = tiny_model("smollm2-135m", vocab_size=32, seed=0)
    model.save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """~3000 words of the tiny tokenizer's vocabulary (one token each)."""
    rng = random.Random(0)
    p = tmp_path_factory.mktemp("corpus") / "text.txt"
    p.write_text(" ".join(rng.choice(TINY_WORDS) for _ in range(3000)), encoding="utf-8")
    return p
