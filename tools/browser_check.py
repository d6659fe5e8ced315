"""Look at the book the way a reader does: in a real browser (headless Debian Chromium).

    python tools/browser_check.py --site _build/site/_build/html [--page book/10_gla_triton.html] [--lab]

Site: serves the built site on 127.0.0.1 and loads every page in Chromium with all other hosts
unresolvable (so math must render from the bundled MathJax, not a CDN). A page fails if any
request it makes gets an error (missing image, script, font, stylesheet), if it has math that
MathJax did not render, or if it links to a page of the site that does not exist. Screenshots
of one chapter page go to --out: its top, and the first figure with the math around it.

--lab: starts JupyterLab (`make lab`'s settings: .py files open as notebooks through jupytext) on
127.0.0.1, opens a chapter in Chromium, checks it opened as a notebook (not as a text file), runs
its first code cells in the kernel and checks their output, and takes a screenshot.

Needs Chromium: installed with apt-get (Debian's `chromium` package) when missing and run as root;
otherwise it says what to install.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import http.server
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run",
         "--disable-component-update", "--disable-sync", "--hide-scrollbars",
         # every host but this machine is unresolvable: nothing may come from the network
         "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"]


def chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        if shutil.which(name):
            return shutil.which(name)
    if os.geteuid() == 0 and shutil.which("apt-get"):
        print("installing Debian's chromium (apt-get) ...", flush=True)
        subprocess.run(["apt-get", "update", "-qq"], check=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", "chromium", "fonts-dejavu-core"], check=True)
        return shutil.which("chromium")
    sys.exit("Chromium is needed: sudo apt-get install chromium (Debian/Ubuntu), then run this again.")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(directory: Path):
    """A static server on 127.0.0.1 that records (path, status) of every request."""
    log: list = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):
            super().__init__(*a, directory=str(directory), **kw)

        def log_request(self, code="-", size="-"):
            log.append((self.path, int(code) if str(code).isdigit() else 0))

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", log
    finally:
        server.shutdown()


# Chromium's helper processes may still write into the throw-away profile while it is removed
# (seen: "Directory not empty: 'Default'"), hence ignore_cleanup_errors on every profile below.
def run_chromium(exe: str, *args, timeout=120) -> str:
    with tempfile.TemporaryDirectory(prefix="chromium-profile-", ignore_cleanup_errors=True) as profile:
        out = subprocess.run([exe, *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True,
                             text=True, timeout=timeout)
    return out.stdout


def dom(exe: str, url: str) -> str:
    """The page's DOM after its scripts ran (MathJax typesets within the virtual-time budget)."""
    return run_chromium(exe, "--virtual-time-budget=15000", "--dump-dom", url)


def screenshot(exe: str, url: str, path: Path, size=(1280, 1800)) -> Path:
    run_chromium(exe, "--virtual-time-budget=15000", f"--window-size={size[0]},{size[1]}",
                 f"--screenshot={path}", url)
    if not path.exists():
        raise RuntimeError(f"no screenshot of {url}")
    return path


def check_site(exe: str, html_dir: Path, page: str, out: Path) -> list[str]:
    sys.path.insert(0, str(ROOT / "tools"))
    import site_book

    problems = list(site_book.check(html_dir)["problems"])           # links and images, statically
    pages = sorted(p.relative_to(html_dir).as_posix() for p in html_dir.rglob("*.html")
                   if "_static" not in p.relative_to(html_dir).parts)
    with serve(html_dir) as (base, log):
        for rel in pages:
            start = len(log)
            text = dom(exe, f"{base}/{rel}")
            # (a browser asks for /favicon.ico by itself; the pages do not reference one)
            failed = [f"{p} ({c})" for p, c in log[start:] if c >= 400 and p != "/favicon.ico"]
            n_math = len(re.findall(r'class="math[ "]', text))
            n_done = text.count("<mjx-container")
            n_img = len(re.findall(r"<img\b", text))
            print(f"  {rel:45s} math {n_done:4d}/{n_math:<4d} images {n_img:3d} failed requests {len(failed)}")
            problems += [f"{rel}: request failed: {f}" for f in failed]
            if n_math and n_done < n_math:
                problems.append(f"{rel}: {n_math - n_done} of {n_math} math elements not rendered by MathJax")
        shots = [screenshot(exe, f"{base}/{page}", out / "chapter_top.png")]
        shot, problem = asyncio.run(figure_with_math(exe, f"{base}/{page}", out / "chapter_figure.png"))
        shots += [shot] if shot else []
        problems += [f"{page}: {problem}"] if problem else []
        for s in shots:
            print(f"  screenshot: {s}")
    return problems


# The figure whose nearest rendered math above it is closest: scroll so both are in view.
FIGURE_NEAR_MATH = """(() => {
    const imgs = [...document.querySelectorAll('img')].filter(i => i.src.includes('/_images/'));
    const maths = [...document.querySelectorAll('mjx-container')].map(m => m.getBoundingClientRect());
    let best = null;
    for (const img of imgs) {
        const r = img.getBoundingClientRect();
        if (!img.complete || img.naturalWidth === 0) return 'image not loaded: ' + img.src;
        const above = maths.filter(m => m.bottom <= r.top);
        if (!above.length) continue;
        const top = Math.max(...above.map(m => m.top));
        if (!best || r.top - top < best.gap) best = {gap: r.top - top, y: top + window.scrollY - 60};
    }
    if (!best) return 'no figure with math above it';
    window.scrollTo(0, best.y);
    return 'ok';
})()"""


async def figure_with_math(exe: str, url: str, path: Path):
    """Screenshot of a figure and the math just above it, after MathJax and images are done."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="chromium-profile-", ignore_cleanup_errors=True) as profile:
        browser = subprocess.Popen([exe, *FLAGS, f"--user-data-dir={profile}", f"--remote-debugging-port={port}",
                                    "--window-size=1280,1400", "about:blank"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            cdp = await CDP.connect(port)
            await cdp.call("Page.enable")
            await cdp.call("Page.navigate", url=url)
            await cdp.until("document.readyState === 'complete' && window.MathJax?.startup?.promise && "
                            "document.querySelectorAll('mjx-container').length > 0", 120, "MathJax")
            await cdp.js("MathJax.startup.promise.then(() => true)")
            verdict = await cdp.js(FIGURE_NEAR_MATH)
            if verdict != "ok":
                return None, verdict
            await asyncio.sleep(1)
            png = await cdp.call("Page.captureScreenshot", format="png")
            path.write_bytes(base64.b64decode(png["data"]))
            return path, None
        finally:
            browser.terminate()
            browser.wait(30)


# --- JupyterLab through the Chrome DevTools protocol (tornado's websocket client: no extra package)

class CDP:
    def __init__(self, ws):
        self.ws, self.n = ws, 0

    @classmethod
    async def connect(cls, port: int):
        from tornado.websocket import websocket_connect

        for _ in range(100):
            try:
                targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list"))
                page = next(t for t in targets if t["type"] == "page")
                return cls(await websocket_connect(page["webSocketDebuggerUrl"], max_message_size=1 << 28))
            except Exception:  # noqa: BLE001  (chromium still starting)
                await asyncio.sleep(0.2)
        raise RuntimeError("Chromium's DevTools endpoint did not come up")

    async def call(self, method: str, **params):
        self.n += 1
        await self.ws.write_message(json.dumps({"id": self.n, "method": method, "params": params}))
        while True:
            msg = json.loads(await self.ws.read_message())
            if msg.get("id") == self.n:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    async def js(self, expr: str):
        res = await self.call("Runtime.evaluate", expression=expr, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"JS failed: {expr[:80]}: {res['exceptionDetails'].get('text')}")
        return res["result"].get("value")

    async def until(self, expr: str, timeout: float, what: str):
        t0 = time.time()
        while time.time() - t0 < timeout:
            with contextlib.suppress(RuntimeError):
                if await self.js(expr):
                    return
            await asyncio.sleep(0.5)
        raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")


async def drive_lab(cdp: CDP, url: str, path: str, shot: Path, n_cells: int) -> list[str]:
    await cdp.call("Page.enable")
    await cdp.call("Page.navigate", url=url)
    # the chapter's tab (a headless window has no focus, so shell.currentWidget stays null)
    await cdp.until("!!(window.jupyterapp && (window.P = [...jupyterapp.shell.widgets('main')]"
                    f".find(w => w.context?.path === {json.dumps(path)})))", 120, "JupyterLab to open the chapter")
    kind = await cdp.js("P.constructor.name + ' ' + P.node.className")
    problems = [] if "jp-NotebookPanel" in kind else [f"the chapter opened as {kind!r}, not as a notebook"]
    if problems:
        return problems
    await cdp.until("P.sessionContext.session?.kernel?.status === 'idle'",
                    180, "the kernel to start")
    ran = await cdp.js(f"""(async () => {{
        const nb = P.content;
        const code = nb.widgets.map((c, i) => [c, i]).filter(([c]) => c.model.type === 'code').slice(0, {n_cells});
        for (const [cell, i] of code) {{
            nb.activeCellIndex = i;
            await jupyterapp.commands.execute('notebook:run-cell');
        }}
        return code.map(([c, i]) => i);
    }})()""")
    await cdp.until("P.sessionContext.session.kernel.status === 'idle' && "
                    "P.content.widgets.filter(c => c.model.type === 'code')"
                    f".slice(0, {n_cells}).every(c => c.model.executionCount)", 240, "the cells to run")
    outputs = await cdp.js(f"""P.content.widgets
        .filter(c => c.model.type === 'code').slice(0, {n_cells})
        .map(c => [c.model.executionCount, c.node.querySelector('.jp-OutputArea')?.innerText || ''])""")
    errors = [o for _, o in outputs if "Error" in o and "Traceback" in o]
    print(f"  ran cells {ran}: execution counts {[c for c, _ in outputs]}")
    for count, text in outputs:
        if text.strip():
            print(f"  [{count}] {text.strip()[:200]}")
    problems += [f"a cell raised: {e[:300]}" for e in errors]
    if not any(text.strip() for _, text in outputs):
        problems.append("no output from the cells that ran")
    # the first code cell after the Colab cell, with its output, at the top of the view
    await cdp.js(f"(async () => {{ await P.content.scrollToItem({ran[1] if len(ran) > 1 else 0}, 'start'); return true }})()")
    await asyncio.sleep(1)
    png = await cdp.call("Page.captureScreenshot", format="png")
    shot.write_bytes(base64.b64decode(png["data"]))
    print(f"  screenshot: {shot}")
    return problems


def check_lab(exe: str, chapter: str, out: Path, n_cells: int = 3) -> list[str]:
    sys.path.insert(0, str(ROOT / "tools"))
    import lab

    lab.setup()                                           # .py opens as a notebook (jupytext)
    # JupyterLab autosaves open documents: it gets a copy of book/, never the chapters themselves
    root = Path(tempfile.mkdtemp(prefix="linattn-lab-"))
    shutil.copytree(ROOT / "book", root / "book", ignore=shutil.ignore_patterns("__pycache__", ".ipynb_checkpoints"))
    port, dbg = free_port(), free_port()
    env = dict(os.environ, JUPYTER_PLATFORM_DIRS="1")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--ServerApp.port={port}",
         "--ServerApp.ip=127.0.0.1", "--IdentityProvider.token=", "--ServerApp.password=",
         "--LabApp.expose_app_in_browser=True", f"--ServerApp.root_dir={root}"]
        + (["--allow-root"] if os.geteuid() == 0 else []),
        stdout=subprocess.DEVNULL, stderr=open(out / "jupyterlab.log", "w"), env=env)
    with tempfile.TemporaryDirectory(prefix="chromium-profile-", ignore_cleanup_errors=True) as profile:
        browser = subprocess.Popen([exe, *FLAGS, f"--user-data-dir={profile}", f"--remote-debugging-port={dbg}",
                                    "--window-size=1400,1100", "about:blank"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for _ in range(240):                          # JupyterLab up?
                if server.poll() is not None:
                    return [f"JupyterLab exited ({server.returncode}): see {out / 'jupyterlab.log'}"]
                with contextlib.suppress(OSError):
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status")
                    break
                time.sleep(0.5)

            async def go():
                cdp = await CDP.connect(dbg)
                return await drive_lab(cdp, f"http://127.0.0.1:{port}/lab/tree/{chapter}", chapter,
                                       out / "lab_chapter.png", n_cells)
            return asyncio.run(go())
        finally:
            browser.terminate()
            server.terminate()
            browser.wait(30)
            server.wait(30)
            shutil.rmtree(root, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--site", type=Path, help="built site (the html directory), e.g. _build/site/_build/html")
    ap.add_argument("--page", default="book/10_gla_triton.html", help="the chapter page to screenshot")
    ap.add_argument("--lab", action="store_true", help="also check JupyterLab")
    ap.add_argument("--lab-chapter", default="book/01_linear_attention.py")
    ap.add_argument("--out", type=Path, default=ROOT / "_build" / "browser", help="screenshots and logs")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    exe = chromium()
    print(subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.strip())
    problems = []
    if args.site:
        print(f"site {args.site}:")
        problems += check_site(exe, args.site, args.page, args.out)
    if args.lab:
        print(f"JupyterLab, {args.lab_chapter}:")
        problems += check_lab(exe, args.lab_chapter, args.out)
    for p in problems:
        print("PROBLEM", p)
    print("browser check:", "ok" if not problems else f"{len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
