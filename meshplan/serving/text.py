"""The text of one choice, on the front's side: the engine's token ids decoded as they come,
cut at the first stop string.

Each ``token`` gives the text it completes that may go out now: what could still be the
beginning of a stop string is held back until the next token decides it. The first stop
string found ends the choice (``reason`` "stop", its text up to the string); ``done``
gives what is left once the engine has ended it (a character left incomplete, what was
held back). Without a tokenizer (a plan whose folder has none) there is no text, only ids.
"""

from __future__ import annotations

from meshplan.generation.driver import TextStream


class ChoiceText:
    def __init__(self, tokenizer, stop: list[str]):
        self.stream = TextStream(tokenizer) if tokenizer is not None else None
        self.stop = list(stop)
        self.text = ""          # its text so far (a stop string cuts it)
        self.sent = 0           # how much of it went out
        self.ids: list[int] = []
        self.reason: str | None = None   # set once it has ended

    def token(self, token: int, end: bool = False) -> str:
        """The text that may go out after ``token`` (``end``: an end token, which has none);
        ``reason`` is "stop" once a stop string has ended the text."""
        self.ids.append(token)
        if self.stream is not None and not end:
            self.text += self.stream.add([token])
        return self._release(final=False)

    def done(self, reason: str) -> str:
        """What is left once the engine ended the choice for ``reason``."""
        if self.stream is not None:
            self.text += self.stream.finish()
        text = self._release(final=True)
        self.reason = self.reason or reason
        return text

    def _release(self, final: bool) -> str:
        if self.stop:
            hits = [i for i in (self.text.find(s) for s in self.stop) if i >= 0]
            if hits:
                self.text, self.reason, final = self.text[:min(hits)], "stop", True
            safe = len(self.text) if final else max(self.sent, len(self.text) - max(map(len, self.stop)) + 1)
        else:
            safe = len(self.text)
        text, self.sent = self.text[self.sent:safe], safe
        return text
