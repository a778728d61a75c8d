"""What an export hands over: the files written and how the framework is launched."""

from __future__ import annotations

from dataclasses import dataclass, field

from mist.errors import MistInputError


@dataclass(frozen=True)
class Export:
    """The launch files of one plan for one framework.

    `args` are the arguments of the framework's entry point exactly as the written launch script
    passes them; `env` the environment variables it sets; `config` the framework's config
    document where it has one (DeepSpeed's ds_config); `files` the paths written, relative to
    the output folder."""

    target: str
    files: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    args: tuple[str, ...] = ()
    config: dict | None = None

    def to_json(self) -> dict:
        out: dict = {"target": self.target, "files": list(self.files), "env": dict(self.env), "args": list(self.args)}
        if self.config is not None:
            out["config"] = self.config
        return out


class NotExpressible(MistInputError):
    """The plan uses a knob the target cannot express (one sentence naming the knob and stage)."""
