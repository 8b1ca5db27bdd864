"""Headless Chromium for the tests of visiontune's HTML pages (report, compare, tune), marked ``browser``."""

from __future__ import annotations

import shutil

import pytest

# Chromium runs under a shell of its own, in a session of its own: whatever the browser does to its parent or
# its process group when it ends reaches that shell, never the test process (a pytest-xdist worker).
BROWSER_SHELL = ["sh", "-c", '"$@"; exit $?', "sh"]


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    pytest.fail(
        "the browser tests need Chromium, which `make test` installs when it runs as root; "
        "install it with `sudo apt-get install chromium` (or `sudo make browser`)",
        pytrace=False,
    )


# Appended to a copy of the page: after the load event, record how many images there are and how
# many failed to decode, where --dump-dom can see it.
CHECK = """<script>window.addEventListener("load", () => {
  const bad = [...document.images].filter(i => !(i.complete && i.naturalWidth > 0)).length;
  document.body.setAttribute("data-images", document.images.length);
  document.body.setAttribute("data-broken", bad);
});</script>"""


def dump_dom(page, profile, *flags: str, budget_ms: int = 5000):
    """``page`` (a file) loaded in headless Chromium with no network, its DOM after the load printed: the
    finished ``subprocess.CompletedProcess`` (``flags`` add to Chromium's, e.g. a window size)."""
    import subprocess

    return subprocess.run(
        [
            *BROWSER_SHELL,
            chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            *flags,
            f"--user-data-dir={profile}",
            "--host-resolver-rules=MAP * ~NOTFOUND",  # any network request would fail loudly
            f"--virtual-time-budget={budget_ms}",
            "--dump-dom",
            page.as_uri(),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=180,
        start_new_session=True,
    )
