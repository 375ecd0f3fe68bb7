"""Chat messages to a prompt with the model folder's chat template, as Hugging Face defines
it: a Jinja2 template in ``tokenizer_config.json`` (``chat_template``: a string, or a list
of named templates of which ``default`` is used) or in ``chat_template.jinja`` beside it,
rendered in a sandbox with ``messages``, ``add_generation_prompt`` and the special tokens
(``bos_token``, ``eos_token``, ...), ``raise_exception`` and the ``tojson`` filter."""

from __future__ import annotations

import json
from pathlib import Path

from meshplan.errors import RunError


class ChatTemplate:
    def __init__(self, source: str, special: dict[str, str]):
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        def tojson(value, indent=None):
            return json.dumps(value, indent=indent, ensure_ascii=False)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = tojson
        try:
            self.template = env.from_string(source)
        except TemplateError as exc:
            raise RunError(f"the model's chat template does not parse: {exc}") from None
        self.special = special

    def render(self, messages: list[dict]) -> str:
        """The prompt text; a ``ValueError`` with one line where the template refuses."""
        from jinja2.exceptions import TemplateError

        try:
            return self.template.render(messages=messages, add_generation_prompt=True, **self.special)
        except TemplateError as exc:
            raise ValueError(f"the chat template refused the messages: {exc}") from None
        except Exception as exc:   # a template's own error on odd messages
            raise ValueError(f"the chat template failed on the messages: {exc}") from None

    @classmethod
    def of_folder(cls, folder: Path) -> "ChatTemplate | None":
        """The folder's template, or None where it has none."""
        config = {}
        path = folder / "tokenizer_config.json"
        if path.is_file():
            try:
                config = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                raise RunError(f"cannot read {path}: {exc}") from None
        source = config.get("chat_template")
        if isinstance(source, list):   # named templates
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not source and (folder / "chat_template.jinja").is_file():
            source = (folder / "chat_template.jinja").read_text()
        if not isinstance(source, str) or not source:
            return None
        special = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = config.get(key)
            if isinstance(value, dict):   # an AddedToken written out
                value = value.get("content")
            if isinstance(value, str):
                special[key] = value
        return cls(source, special)
