"""Drive the memory server's audit page in a real headless browser (Chromium via QtWebEngine).

Run as a script by ``test_memory_server.py``::

    python tests/_headless_browser.py URL TOKEN

Loads ``URL`` in a QtWebEngine page (the Chromium engine; offscreen, no display needed), and
acts as a user would: types the token, presses Load, waits for the page's status line, presses
"More records" while it is shown, presses "Run an audit now", and then types a wrong token and
presses Load again. After each step it reads what the page shows (the state table, every row
of the record, receipt and audit tables, the status line, the JavaScript console's errors) and
prints all of it as one JSON object on stdout.
"""

from __future__ import annotations

import json
import os
import sys

# before Qt starts: no display, no GPU, and Chromium's sandbox off (it refuses to run as root)
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ["QTWEBENGINE_CHROMIUM_FLAGS"] = " ".join(
    f for f in (os.environ.get("QTWEBENGINE_CHROMIUM_FLAGS", ""), "--no-sandbox",
                "--disable-gpu") if f)

from PyQt6.QtCore import QTimer, QUrl  # noqa: E402
from PyQt6.QtWebEngineCore import QWebEnginePage  # noqa: E402
from PyQt6.QtWidgets import QApplication  # noqa: E402

# what the page shows, read from the DOM (textContent: what a user sees, not the markup)
READ = """(function () {
  function text(id) { return document.getElementById(id).textContent; }
  function rows(id) {
    return Array.from(document.getElementById(id).rows).map(function (tr) {
      return Array.from(tr.cells).map(function (c) { return c.textContent; });
    });
  }
  return JSON.stringify({
    status: text("status"), status_class: document.getElementById("status").className,
    state: {n: text("state-n"), revision: text("state-revision"), digest: text("state-digest")},
    records: rows("record-rows"), receipts: rows("receipt-rows"), audit: rows("audit-rows"),
    more_records_hidden: document.getElementById("more-records").hidden,
    more_receipts_hidden: document.getElementById("more-receipts").hidden});
})()"""
STEP_SECONDS = 60  # the longest a step may wait for the page's status line


class Page(QWebEnginePage):
    """A page that keeps the JavaScript console's errors."""

    def __init__(self):
        super().__init__()
        self.console_errors = []

    def javaScriptConsoleMessage(self, level, message, line, source):
        if level == QWebEnginePage.JavaScriptConsoleMessageLevel.ErrorMessageLevel:
            self.console_errors.append(f"{source}:{line}: {message}")


class Session:
    """The user's steps, each run when the previous one's page status settled."""

    def __init__(self, app, url, token):
        self.app, self.url, self.token = app, url, token
        self.page = Page()
        self.out = {"loaded": False, "steps": {}}
        # (name, what the user does, when the page has settled: a test of what it shows)
        self.steps = [
            ("load", self._type_token_and_load(token),
             lambda shown: shown["status"].startswith("loaded ")),
            ("more_records", "document.getElementById('more-records').click()",
             lambda shown: shown["more_records_hidden"]),
            ("audit", "document.getElementById('run-audit').click()",
             lambda shown: shown["status"] == "audited"),
            ("wrong_token", self._type_token_and_load("not-the-token"),
             lambda shown: False),  # settles on the error
        ]
        self.page.loadFinished.connect(self._loaded)
        QTimer.singleShot(4 * STEP_SECONDS * 1000, self._give_up)

    @staticmethod
    def _type_token_and_load(token):
        return (f"document.getElementById('token').value = {json.dumps(token)};"
                "document.getElementById('load').click()")

    def start(self):
        self.page.load(QUrl(self.url))

    def _loaded(self, ok):
        self.out["loaded"] = bool(ok)
        if not ok:
            self._finish()
            return
        self.out["title"] = self.page.title()
        self._next()

    def _next(self):
        if not self.steps:
            self._finish()
            return
        name, script, settled = self.steps.pop(0)
        self.page.runJavaScript("document.getElementById('status').textContent = ''")
        self.page.runJavaScript(script)
        self._wait(name, settled, tries=STEP_SECONDS * 10)

    def _wait(self, name, settled, tries):
        """Read the page every 0.1 s until ``settled(shown)`` or the status shows an error."""

        def check(raw):
            shown = json.loads(raw)
            if settled(shown) or shown["status_class"] == "error" or tries <= 0:
                self.out["steps"][name] = shown
                self._next()
            else:
                QTimer.singleShot(100, lambda: self._wait(name, settled, tries - 1))

        self.page.runJavaScript(READ, check)

    def _give_up(self):
        self.out["timed_out"] = True
        self._finish()

    def _finish(self):
        self.out["console_errors"] = self.page.console_errors
        self.out["user_agent"] = self.page.profile().httpUserAgent()
        print(json.dumps(self.out), flush=True)
        self.app.quit()


def main(argv):
    url, token = argv
    app = QApplication([sys.argv[0]])
    session = Session(app, url, token)
    session.start()
    app.exec()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
