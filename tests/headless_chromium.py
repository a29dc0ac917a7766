"""Headless Chromium for the dashboard tests: load a page, let its script run, return the DOM it built.

Debian's `chromium` (installed by scripts/test.sh as root) with `--dump-dom` after a virtual-time
budget; `parse_dom` turns the dump into elements that the tests query by id and attribute;
`serve_files` serves a page of the test's making (the dashboard's files plus a measuring script).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from html.parser import HTMLParser
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--no-first-run", "--disable-extensions", "--mute-audio",
]  # fmt: skip


def chromium() -> str:
    """The Chromium executable; fails the test (not skips) with how to install it."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        raise AssertionError("no chromium on PATH: run scripts/test.sh (as root) or `apt-get install chromium`")
    return path


def _run(args: list[str], timeout: float) -> str:
    with tempfile.TemporaryDirectory(prefix="murmur-chromium-") as profile:
        done = subprocess.run(
            [chromium(), *FLAGS, f"--user-data-dir={profile}", *args],
            capture_output=True, text=True, timeout=timeout, check=False,
        )  # fmt: skip
    if done.returncode != 0:
        raise AssertionError(f"chromium exited {done.returncode}: {done.stderr[-2000:]}")
    return done.stdout


def dump_dom(url: str, budget_ms: int = 4000, timeout: float = 60.0) -> str:
    """The page's DOM after `budget_ms` of virtual time (its polls and timers have run)."""
    return _run([f"--virtual-time-budget={budget_ms}", "--dump-dom", url], timeout)


def screenshot(url: str, path: Path, size: tuple[int, int] = (1280, 1400), budget_ms: int = 4000) -> None:
    _run([f"--virtual-time-budget={budget_ms}", f"--window-size={size[0]},{size[1]}", "--hide-scrollbars",
          f"--screenshot={path}", url], 60.0)  # fmt: skip
    if not path.exists() or path.stat().st_size == 0:
        raise AssertionError(f"chromium wrote no screenshot to {path}")


@dataclass
class Element:
    tag: str
    attrs: dict[str, str]
    parent: Element | None
    children: list[Element] = field(default_factory=list)
    text: list[str] = field(default_factory=list)

    def all_text(self) -> str:
        return "".join(self.text) + "".join(c.all_text() for c in self.children)

    def find_all(self, tag: str) -> list[Element]:
        found = []
        for child in self.children:
            if child.tag == tag:
                found.append(child)
            found += child.find_all(tag)
        return found


class _Parser(HTMLParser):
    VOID = {"meta", "link", "br", "img", "input", "hr", "source", "col", "area", "base", "wbr", "embed"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Element("#root", {}, None)
        self.current = self.root
        self.by_id: dict[str, Element] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        element = Element(tag, {k: v or "" for k, v in attrs}, self.current)
        self.current.children.append(element)
        if "id" in element.attrs:
            self.by_id[element.attrs["id"]] = element
        if tag not in self.VOID:
            self.current = element

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.handle_starttag(tag, attrs)
        if tag not in self.VOID:
            self.current = self.current.parent or self.root

    def handle_endtag(self, tag: str) -> None:
        node = self.current
        while node is not self.root and node.tag != tag:
            node = node.parent or self.root
        if node is not self.root:
            self.current = node.parent or self.root

    def handle_data(self, data: str) -> None:
        self.current.text.append(data)


def parse_dom(html: str) -> tuple[Element, dict[str, Element]]:
    """The document's root element and its elements by id."""
    parser = _Parser()
    parser.feed(html)
    parser.close()
    return parser.root, parser.by_id


def peer_rows(by_id: dict[str, Element]) -> dict[str, str]:
    """The peer table's rows: peer ID (its `data-peer`) -> the row's text."""
    return {tr.attrs["data-peer"]: tr.all_text() for tr in by_id["peers"].find_all("tr") if "data-peer" in tr.attrs}


def chart_points(by_id: dict[str, Element], chart: str) -> dict[str, int]:
    """Each polyline of `chart` (by its `data-peer`) -> how many points it draws."""
    return {
        line.attrs.get("data-peer", ""): len(line.attrs.get("points", "").split())
        for line in by_id[chart].find_all("polyline")
    }


@contextmanager
def serve_files(files: dict[str, tuple[bytes, str]]) -> Iterator[str]:
    """Serve `files` (path -> (body, content type)) on a loopback port; yields the base URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = self.path.split("?", 1)[0]
            body, kind = files.get(path, (b"not found\n", "text/plain"))
            self.send_response(200 if path in files else 404)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
