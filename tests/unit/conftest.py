"""tests/unit/ runs no vLLM engine: the tests that can run alone, in seconds."""

import pytest

from vlens.engine.engine import Engine


@pytest.fixture(autouse=True)
def no_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a test in tests/unit/ built a vLLM engine: it belongs in tests/engine/")

    monkeypatch.setattr(Engine, "__init__", refuse)
