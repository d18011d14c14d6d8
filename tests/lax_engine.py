"""A lax engine on a bare socket, for security tests: it reads no body on GET or DELETE (whatever Content-Length
says, as some servers do), so bytes relayed after such a request are taken as the next request on the connection;
it can refuse or echo the credentials it is sent. Every request it parses is recorded."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field

import orjson

_ids = itertools.count(1)


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class LaxEngine:
    model: str = "m"
    key: str | None = None  # the key it wants (401 echoing what it got, otherwise)
    echo_key: bool = False  # its replies quote the Authorization header it got
    refuse_status: int = 401
    seen: list[Seen] = field(default_factory=list)
    stored: dict[str, dict] = field(default_factory=dict)
    server: asyncio.Server | None = None

    async def start(self) -> "LaxEngine":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    def requests(self, path_start: str = "/v1/") -> list[Seen]:
        return [s for s in self.seen if s.path.startswith(path_start)]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                length = int(headers.get("content-length", "0"))
                # Lax: a GET or DELETE has no body here, whatever its Content-Length says.
                body = b"" if method in ("GET", "DELETE") else await reader.readexactly(length)
                self.seen.append(Seen(method, path, headers, body))
                status, reply = self._answer(method, path, headers, body)
                data = orjson.dumps(reply)
                writer.write(b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                             % (status, len(data)) + data)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            writer.close()

    def _answer(self, method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, dict]:
        if path in ("/health", "/v1/models") or not path.startswith("/v1/"):
            return 200, {"object": "list", "data": [{"id": self.model, "object": "model"}]}
        presented = headers.get("authorization", "")
        if self.key is not None and presented != f"Bearer {self.key}":
            return self.refuse_status, {"error": {"message": f"Invalid API key: {presented!r}", "type": "auth",
                                                  "code": "invalid_api_key"}}
        said = f" (you sent {presented})" if self.echo_key else ""
        if path == "/v1/chat/completions":
            prompt = orjson.loads(body)["messages"][-1]["content"]
            return 200, {"id": "c1", "object": "chat.completion", "created": 1, "model": self.model,
                         "choices": [{"index": 0, "message": {"role": "assistant", "content": f"chat for {prompt}{said}"},
                                      "finish_reason": "stop"}],
                         "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}}
        if path == "/v1/messages":
            return 200, {"id": "msg_1", "type": "message", "role": "assistant", "model": self.model,
                         "content": [{"type": "text", "text": f"hi{said}"}], "stop_reason": "end_turn",
                         "usage": {"input_tokens": 3, "output_tokens": 1}}
        if path == "/v1/responses" and method == "POST":
            rid = f"resp_lax{next(_ids):08d}"
            resp = {"id": rid, "object": "response", "status": "completed", "model": self.model,
                    "output": [{"type": "message", "id": "msg_1", "role": "assistant",
                                "content": [{"type": "output_text", "text": f"ok{said}"}]}],
                    "usage": {"input_tokens": 3, "output_tokens": 1, "total_tokens": 4}}
            self.stored[rid] = resp
            return 200, resp
        if path.startswith("/v1/responses/"):
            rid = path.split("?")[0].split("/")[3]
            if rid not in self.stored:
                return 404, {"error": {"message": f"Response with id '{rid}' not found.", "code": 404}}
            if method == "DELETE":
                return 200, {"id": rid, "object": "response.deleted", "deleted": True}
            if path.split("?")[0].endswith("/cancel"):
                return 400, {"error": {"message": "Cannot cancel a synchronous response.", "code": 400}}
            return 200, self.stored[rid]
        return 404, {"detail": "Not Found"}
