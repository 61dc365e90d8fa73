"""Open the built documentation site in a headless browser and check it as a reader would: ``make docs-check``
(``python -m launch.docs.browser_check site [--screenshots DIR]``).

The browser is Debian's Chromium, driven through Debian's ChromeDriver by selenium (the ``docs`` extra):
``apt-get install chromium chromium-driver``. The site is served on 127.0.0.1 by Python's http.server, and the browser
starts with no background networking, so nothing but the site is reached. It checks:

- the home page and every API page render: the title, the navigation, the headings;
- each name of ``syncbn_dist.__all__`` has its entry on the API pages, visible;
- every link of the API pages that carries an ``#anchor`` lands on an element of that id (the target page loaded
  in the browser), and opening ``api/conversion.html#syncbn_dist.convert_model`` scrolls to the entry;
- the search index the browser loads holds ``convert_model``, and typing it in the search box lists its entry;
- the design page's diagrams and the compare and performance plots load (decoded, non-zero size);
- every page of the site (the guides, the API pages, the rest; not the ``source/`` pages): each code block fits
  100 columns and shows whole at this window's 1280 pixels, nothing cut off on the right;
- no repository path is plain text in the prose (launch/docs/site_text.py: a page or docstring links the file);
- the Layers page's table of contents names each class whole (not three "SynchronizedBatchNor…");
- the site from disk: ``site/index.html`` opened as a ``file://`` page has a search box, and typing a query lists
  results, with no error in the console;
- every resource a page loaded came from the site itself, and the browser logged no error.

With ``--screenshots DIR`` it saves a picture of each page it opens (the guides among them) and of the searches.

Exit status 0 when every check passes, 1 otherwise (each failure printed), 2 when no browser is installed.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from launch.docs.site_text import MAX_COLUMNS, path_text

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--window-size=1280,900",
)
API_PAGES = ("api.html", "api/layers.html", "api/conversion.html", "api/data_parallel.html", "api/join.html",
             "api/switches.html", "api/errors.html")
PICTURES = (("design.html", "transports.svg"), ("design.html", "step.svg"), ("compare.html", "compare.png"),
            ("performance.html", "performance.png"))
# The entries the Layers page's table of contents must show whole.
TOC_NAMES = {"api/layers.html": ("SyncBatchNorm", "SynchronizedBatchNorm1d", "SynchronizedBatchNorm2d",
                                 "SynchronizedBatchNorm3d", "new_sync_groups", "sync_running_stats")}
# Each code block of the page: its first line, its widest line in characters, and whether it shows whole (nothing
# past the right edge of its box).
_CODE_BLOCKS = """
return Array.from(document.querySelectorAll('article pre > code')).map(code => {
  const lines = code.textContent.replace(/\\n$/, '').split('\\n');
  return [lines[0], Math.max(...lines.map(l => l.length)), code.scrollWidth <= code.clientWidth + 1];
});
"""
# An entry of the secondary sidebar's table of contents, by its text: [text, fits its box, lines the name takes].
_TOC_ENTRIES = """
return Array.from(document.querySelectorAll('.md-sidebar--secondary nav.md-nav--secondary a.md-nav__link')).map(a => {
  const span = a.querySelector('.md-ellipsis') || a;
  const name = Array.from(span.childNodes).filter(n => n.nodeType === 3).pop();
  const range = document.createRange();
  if (name) {
    range.setStart(name, name.textContent.search(/\\S/));
    range.setEnd(name, name.textContent.trimEnd().length);
  }
  return [a.textContent.trim(), span.scrollWidth <= span.clientWidth + 1, name ? range.getClientRects().length : 0];
});
"""


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def public_names(root: Path) -> list[str]:
    """``syncbn_dist.__all__`` from the source, without importing torch."""
    import ast

    tree = ast.parse((root / "syncbn_dist" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise ValueError("syncbn_dist/__init__.py has no literal __all__")


def _driver(user_data_dir: str) -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, f"--user-data-dir={user_data_dir}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


class Checks:
    """Each check records its failures instead of stopping at the first."""

    def __init__(self, driver: Any, base: str, screenshots: Optional[Path]) -> None:
        self.driver, self.base, self.screenshots = driver, base, screenshots
        self.failures: list[str] = []
        self.passed = 0

    def expect(self, condition: bool, what: str) -> None:
        if condition:
            self.passed += 1
        else:
            self.failures.append(what)
            print(f"FAIL {what}", flush=True)

    def open(self, page: str) -> None:
        self.driver.get(self.base + page)
        self.driver.execute_script("return document.readyState")  # get() waits for the load event
        logs = self.driver.get_log("browser")
        errors = [entry["message"] for entry in logs if entry["level"] == "SEVERE"]
        self.expect(not errors, f"{page}: the browser logged errors: {errors}")
        outside = self.driver.execute_script(
            "return performance.getEntriesByType('resource').map(e => e.name)"
            ".filter(n => !n.startsWith(location.origin))"
        )
        self.expect(not outside, f"{page}: loaded from outside the site: {outside}")
        if self.screenshots is not None:
            self.driver.save_screenshot(str(self.screenshots / (page.replace("/", "_") + ".png")))

    def js(self, script: str, *args: Any) -> Any:
        return self.driver.execute_script(script, *args)

    def wait(self, predicate: Callable[[], Any], seconds: float = 10.0) -> Any:
        from selenium.common.exceptions import TimeoutException
        from selenium.webdriver.support.ui import WebDriverWait

        try:
            return WebDriverWait(self.driver, seconds, poll_frequency=0.1).until(lambda _: predicate())
        except TimeoutException:
            return None


def site_pages(site: Path) -> list[str]:
    """Every page of the built site a reader reaches from the navigation (not the ``source/`` pages, not 404)."""
    return sorted(path.relative_to(site).as_posix() for path in site.rglob("*.html")
                  if not path.relative_to(site).as_posix().startswith("source/") and path.name != "404.html")


def check_pages(checks: Checks, pages: Sequence[str]) -> None:
    """Every page: its code blocks fit :data:`MAX_COLUMNS` and show whole; the table of contents names its entries."""
    for page in pages:
        checks.open(page)
        for first, columns, whole in checks.js(_CODE_BLOCKS):
            checks.expect(columns <= MAX_COLUMNS, f"{page}: a code block {columns} columns wide ({first[:60]!r})")
            checks.expect(whole, f"{page}: a code block is cut off on the right at 1280 pixels ({first[:60]!r})")
        if page in TOC_NAMES:
            entries = {text.split()[-1]: (fits, lines) for text, fits, lines in checks.js(_TOC_ENTRIES)}
            for name in TOC_NAMES[page]:
                fits, lines = entries.get(name, (False, 0))
                checks.expect(fits and lines == 1,
                              f"{page}: the table of contents does not show {name} whole (entries: {sorted(entries)})")


def check_search_from_disk(checks: Checks, site: Path) -> None:
    """``site/index.html`` as a file: a search box, and a query lists results (Material's offline plugin)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    driver = checks.driver
    driver.get((site.resolve() / "index.html").as_uri())
    boxes = driver.find_elements(By.CSS_SELECTOR, "input.md-search__input")
    shown = bool(boxes) and boxes[0].is_displayed()
    checks.expect(shown, "file:// index.html: no search box")
    if not shown:
        return
    boxes[0].click()
    boxes[0].send_keys("join_layers")
    boxes[0].send_keys(Keys.SPACE)
    hits = checks.wait(lambda: [a.get_attribute("href") for a in
                                driver.find_elements(By.CSS_SELECTOR, ".md-search-result__item a")
                                if "syncbn_dist.join_layers" in (a.get_attribute("href") or "")])
    checks.expect(bool(hits) and all(hit.startswith("file://") for hit in hits),
                  "file:// index.html: typing join_layers lists no file:// link to its entry")
    errors = [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
    checks.expect(not errors, f"file:// index.html: the browser logged errors: {errors}")
    if checks.screenshots is not None:
        driver.save_screenshot(str(checks.screenshots / "search_from_disk.png"))


def run_checks(checks: Checks, names: Sequence[str]) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    driver = checks.driver
    # The home page renders: the README's title and sections, the navigation, highlighted code.
    checks.open("index.html")
    checks.expect("syncbn_dist" in driver.title, f"home page title: {driver.title!r}")
    h1 = driver.find_elements(By.CSS_SELECTOR, "article h1")
    checks.expect(bool(h1) and h1[0].text.strip() == "syncbn_dist", "home page: the README's title as its h1")
    headings = [e.get_attribute("id") for e in driver.find_elements(By.CSS_SELECTOR, "article h2")]
    checks.expect({"quick-start", "install", "how-the-transport-is-chosen"} <= set(headings),
                  f"home page: the README's sections (got {headings})")
    nav = [e.get_attribute("textContent").strip() for e in driver.find_elements(By.CSS_SELECTOR, "nav.md-nav a")]
    checks.expect({"API reference", "Join", "DataParallel", "Changelog"} <= set(nav), f"navigation: {sorted(set(nav))}")
    checks.expect(bool(driver.find_elements(By.CSS_SELECTOR, "article .highlight code span")),
                  "home page: highlighted code")

    # The API pages render every public name once, visibly, and every anchored link lands on an element.
    entries: dict[str, list[str]] = {}
    anchored: set[str] = set()
    for page in API_PAGES:
        checks.open(page)
        checks.expect(bool(driver.find_elements(By.CSS_SELECTOR, "article h1")), f"{page}: no title")
        for element in driver.find_elements(By.CSS_SELECTOR, "article [id^='syncbn_dist.']"):
            name = element.get_attribute("id")[len("syncbn_dist.") :]
            if name in names:
                entries.setdefault(name, []).append(page)
                checks.expect(element.is_displayed(), f"{page}: the entry of {name} is not displayed")
        hrefs = checks.js("return Array.from(document.querySelectorAll('article a[href*=\"#\"]')).map(a => a.href)")
        anchored.update(href for href in hrefs if href.startswith(checks.base))
    for name in names:
        checks.expect(len(entries.get(name, [])) == 1, f"{name}: entries on {entries.get(name, [])}, expected one")
    by_page: dict[str, set[str]] = {}
    for href in anchored:
        page, _, anchor = href.partition("#")
        by_page.setdefault(page, set()).add(anchor)
    for page, anchors in sorted(by_page.items()):
        checks.open(page[len(checks.base) :])
        missing = [a for a in sorted(anchors) if not checks.js("return !!document.getElementById(arguments[0])", a)]
        checks.expect(not missing, f"{page}: no element for #{missing} (linked from the API pages)")
    print(f"anchors: {sum(len(a) for a in by_page.values())} distinct anchored links of the API pages, on "
          f"{len(by_page)} pages", flush=True)
    driver.get(checks.base + "api/conversion.html#syncbn_dist.convert_model")
    top = checks.wait(lambda: checks.js(
        "const e = document.getElementById('syncbn_dist.convert_model');"
        "const t = e.getBoundingClientRect().top; return (t >= 0 && t < innerHeight / 2) ? t + 1 : 0"))
    checks.expect(bool(top), "api/conversion.html#syncbn_dist.convert_model does not scroll to the entry")

    # The search: the index the page loads holds convert_model, and typing it lists the entry.
    checks.open("index.html")
    index = checks.js("return fetch('search/search_index.json').then(r => r.json())")
    locations = [doc["location"] for doc in index["docs"]]
    checks.expect("api/conversion.html#syncbn_dist.convert_model" in locations,
                  "search index: no entry api/conversion.html#syncbn_dist.convert_model")
    checks.expect(any("convert_model" in doc["text"] for doc in index["docs"]), "search index: no text convert_model")
    box = driver.find_element(By.CSS_SELECTOR, "input.md-search__input")  # in the header, at this window's width
    box.click()
    box.send_keys("convert_model")
    box.send_keys(Keys.SPACE)
    hits = checks.wait(lambda: [a.get_attribute("href") for a in
                                driver.find_elements(By.CSS_SELECTOR, ".md-search-result__item a")
                                if "syncbn_dist.convert_model" in (a.get_attribute("href") or "")])
    checks.expect(bool(hits), "search box: typing convert_model lists no link to its entry")
    if checks.screenshots is not None:
        driver.save_screenshot(str(checks.screenshots / "search.png"))

    # The pictures load: decoded, with a size.
    for page, image in PICTURES:
        checks.open(page)
        loaded = checks.wait(lambda image=image: checks.js(
            "const i = Array.from(document.images).find(i => i.getAttribute('src') === arguments[0]);"
            "return i && i.complete && i.naturalWidth > 0 ? [i.naturalWidth, i.naturalHeight] : null", image))
        checks.expect(bool(loaded), f"{page}: {image} did not load")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("site", type=Path, help="the built site (make docs writes site/)")
    parser.add_argument("--screenshots", type=Path, help="save a screenshot of each page opened here")
    args = parser.parse_args(argv)
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if shutil.which(path) is None]
    if missing:
        print(f"no browser: {', '.join(missing)} missing (apt-get install chromium chromium-driver)", file=sys.stderr)
        return 2
    if not (args.site / "index.html").is_file():
        print(f"{args.site}/index.html is missing: make docs builds the site", file=sys.stderr)
        return 1
    if args.screenshots is not None:
        args.screenshots.mkdir(parents=True, exist_ok=True)
    handler = functools.partial(_QuietHandler, directory=str(args.site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    root = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory(prefix="docs-check-") as profile:
        driver = _driver(profile)
        try:
            print(f"{driver.capabilities.get('browserName')} {driver.capabilities.get('browserVersion')} "
                  f"headless on {base}", flush=True)
            checks = Checks(driver, base, args.screenshots)
            run_checks(checks, public_names(root))
            pages = site_pages(args.site)
            check_pages(checks, pages)
            print(f"pages: {len(pages)} opened for code widths and tables of contents", flush=True)
            for hit in path_text(args.site):
                checks.expect(False, f"{hit.page}: {hit.path!r} is plain text in the prose ({hit.owner or 'page'}): "
                                     f"{hit.context!r}")
            check_search_from_disk(checks, args.site)
        finally:
            driver.quit()
            server.shutdown()
    print(f"docs-check: {checks.passed} passed, {len(checks.failures)} failed", flush=True)
    return 1 if checks.failures else 0


if __name__ == "__main__":
    sys.exit(main())
