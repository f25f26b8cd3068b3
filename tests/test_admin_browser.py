"""The admin in a real headless Chromium against a live server.

Uses the system's browser and driver (Debian ``chromium`` and
``chromium-driver``, installed by scripts/bootstrap); nothing is downloaded.
A browser that cannot start fails these tests, it never skips them.
Screenshots go to ``$SEMAPHORE_SCREENSHOTS`` (default
``.runtime/screenshots/``); the folder is printed at the end of the run.

Marked ``any_database``: what a browser adds (the pages' scripts, forms and
look) is the same on every database; the admin's queries and actions behind
these pages are tested on each database by test_admin.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth import get_user_model
from django.contrib.staticfiles.handlers import StaticFilesHandler
from django.db import connection
from django.test.testcases import LiveServerThread
from django.test.utils import override_settings
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.select import Select
from selenium.webdriver.support.wait import WebDriverWait

from django_semaphore import acquire, release, set_capacity
from django_semaphore.models import CapacityChange, PermitRequest, Semaphore
from django_semaphore.states import ReleaseReason, State
from tests.conftest import unique

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
SCREENSHOTS = Path(os.environ.get("SEMAPHORE_SCREENSHOTS", REPO / ".runtime" / "screenshots"))
PASSWORD = "correct horse battery staple"
WIDTH, HEIGHT = 1600, 900

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.any_database]


# --- the live server, the browser, the background process ----------------------------


@pytest.fixture(scope="module")
def server(django_db_setup, django_db_blocker) -> Iterator[str]:
    """A live server that also serves the admin's CSS and JavaScript.

    The test settings have no ``staticfiles`` app, so pytest-django's
    ``live_server`` would serve pages without their styles (and screenshots
    without their look); Django's own ``StaticFilesHandler`` finds the files
    in the apps' ``static`` folders instead.
    """
    settings = override_settings(STATIC_URL="/static/", ALLOWED_HOSTS=["127.0.0.1"])
    with settings, django_db_blocker.unblock():
        thread = LiveServerThread("127.0.0.1", StaticFilesHandler, connections_override={})
        thread.daemon = True
        thread.start()
        thread.is_ready.wait()
        if thread.error:
            raise thread.error
        try:
            yield f"http://127.0.0.1:{thread.port}"
        finally:
            thread.terminate()


@pytest.fixture(scope="module")
def browser(pytestconfig) -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    # In the checkout's runtime dir, and removed afterwards: a run leaves
    # nothing behind in /tmp.
    (REPO / ".runtime").mkdir(exist_ok=True)
    profile = tempfile.mkdtemp(prefix="chromium-profile-", dir=REPO / ".runtime")
    for flag in [
        "--headless=new",
        "--no-sandbox",  # running as root in a container
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--window-size={WIDTH},{HEIGHT}",
        "--force-device-scale-factor=1",
        "--lang=en-US",
        f"--user-data-dir={profile}",
    ]:
        options.add_argument(flag)
    # Both paths given: Selenium Manager has nothing to look up or download.
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    driver.implicitly_wait(0)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
        # Past output capturing, so the folder shows in every run's output.
        reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
        capture = pytestconfig.pluginmanager.get_plugin("capturemanager")
        if reporter is not None and capture is not None:
            with capture.global_and_fixture_disabled():
                reporter.write_line(f"\nadmin screenshots: {SCREENSHOTS}")


class Holder:
    """A separate Python process holding permits, as a worker would."""

    def __init__(self, names: dict[str, int], key: str) -> None:
        self.key = key
        self.process = subprocess.Popen(
            [sys.executable, "-c", HOLDER, connection.settings_dict["NAME"], key, repr(names)],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.answer() == "held"

    def answer(self) -> str:
        assert self.process.stdout is not None
        line = self.process.stdout.readline().strip()
        assert line, f"the holder exited with {self.process.wait(timeout=30)}"
        return line

    def ask(self, command: str) -> str:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self.answer()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)


HOLDER = """
import os, sys, ast
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
import django
django.setup()
from django.db import connections
connections["default"].settings_dict["NAME"] = sys.argv[1]  # the test database
from django_semaphore import acquire, renew, release
from django_semaphore.exceptions import PermitAlreadyReleased
key = sys.argv[2]
acquire(ast.literal_eval(sys.argv[3]), external_id=key, owner=f"worker-pid-{os.getpid()}")
print("held", flush=True)
for command in sys.stdin:
    if command.strip() == "renew":
        try:
            renew(key, ttl=60)
            print("renewed", flush=True)
        except PermitAlreadyReleased:
            print("lost", flush=True)
    elif command.strip() == "release":
        print(release(key).name, flush=True)
"""


@pytest.fixture
def holder(transactional_db) -> Iterator[Callable[[dict[str, int]], Holder]]:
    started: list[Holder] = []

    def start(names: dict[str, int]) -> Holder:
        started.append(Holder(names, unique("job")))
        return started[-1]

    yield start
    for process in started:
        process.stop()


# --- helpers ------------------------------------------------------------------------------


def log_in(browser: webdriver.Chrome, server: str, *permissions: str) -> str:
    """Create a staff user (superuser without ``permissions``), log in through the form."""
    from django.contrib.auth.models import Permission

    username = unique("ops")
    user = get_user_model().objects.create_user(
        username, password=PASSWORD, is_staff=True, is_superuser=not permissions
    )
    user.user_permissions.set(Permission.objects.filter(codename__in=permissions))
    browser.delete_all_cookies()
    browser.get(f"{server}/admin/login/?next=/admin/")
    browser.find_element(By.NAME, "username").send_keys(username)
    browser.find_element(By.NAME, "password").send_keys(PASSWORD)
    follow(browser, browser.find_element(By.CSS_SELECTOR, "input[type=submit]"))
    assert "/admin/login/" not in browser.current_url
    return username


def follow(browser: webdriver.Chrome, element: WebElement) -> None:
    """Click, then wait until the next page has replaced this one."""
    page = browser.find_element(By.TAG_NAME, "html")
    element.click()
    WebDriverWait(browser, 20).until(lambda _: replaced(page))
    wait_for(browser, "#footer")


def replaced(page: WebElement) -> bool:
    """Whether ``page`` belongs to a document the browser has left.

    Chromedriver reports it in two ways: a stale element, or - when asked in
    the middle of the navigation - an inspector error naming a node that
    "does not belong to the document" (Selenium's ``staleness_of`` knows
    only the first, and raised the second in a CI run).
    """
    try:
        page.is_enabled()
    except StaleElementReferenceException:
        return True
    except WebDriverException as error:
        if "does not belong to the document" in str(error.msg):
            return True
        raise
    return False


def wait_for(browser: webdriver.Chrome, selector: str) -> WebElement:
    return WebDriverWait(browser, 20).until(
        expected_conditions.presence_of_element_located((By.CSS_SELECTOR, selector))
    )


def row_of(browser: webdriver.Chrome, text: str) -> WebElement:
    return browser.find_element(
        By.XPATH, f"//table[@id='result_list']//tr[.//*[normalize-space()='{text}']]"
    )


def cell(row: WebElement, field: str) -> str:
    return row.find_element(By.CSS_SELECTOR, f".field-{field}").text.strip()


def screenshot(browser: webdriver.Chrome, name: str) -> Path:
    """Save the whole page (the window grows to fit it)."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    height = browser.execute_script("return document.documentElement.scrollHeight")
    browser.set_window_size(WIDTH, max(HEIGHT, min(int(height), 4000)))
    path = SCREENSHOTS / f"{name}.png"
    assert browser.save_screenshot(str(path))
    browser.set_window_size(WIDTH, HEIGHT)
    return path


def fake_history(sem: Semaphore, spans: list[tuple[float, float, int]]) -> None:
    """Requests of the past day: (hours ago it started, hours ago it ended, count)."""
    for started, ended, count in spans:
        request = acquire({sem.name: count}, external_id=unique("past"), owner="nightly-job")
        release(request.external_id)
        now = PermitRequest.objects.get(pk=request.pk).released_at
        assert now is not None
        PermitRequest.objects.filter(pk=request.pk).update(
            created_at=now - timedelta(hours=started),
            released_at=now - timedelta(hours=ended),
        )


# --- the tests ------------------------------------------------------------------------------


def test_changelist_shows_what_a_background_process_holds(browser, server, holder):
    prefix = unique("console")
    exports = Semaphore.objects.create(name=f"{prefix}-exports", capacity=3)
    network = Semaphore.objects.create(name=f"{prefix}-network", capacity=2)
    idle = Semaphore.objects.create(name=f"{prefix}-idle", capacity=5)
    holder({exports.name: 2, network.name: 1})
    holder({network.name: 1})
    holder({exports.name: 1})
    set_capacity(exports.name, 2, reason="maintenance")  # now over capacity
    log_in(browser, server)

    browser.get(f"{server}/admin/django_semaphore/semaphore/?q={prefix}")

    wait_for(browser, "#result_list")
    rows = {name: row_of(browser, name) for name in (exports.name, network.name, idle.name)}
    assert [cell(rows[exports.name], f) for f in ("capacity", "in_use", "holders")] == [
        "2",
        "3",
        "2",
    ]
    assert [cell(rows[network.name], f) for f in ("in_use", "available", "holders")] == [
        "2",
        "0",
        "2",
    ]
    assert cell(rows[idle.name], "in_use") == "0"
    exports_bar = rows[exports.name].find_element(By.CSS_SELECTOR, ".semaphore-bar")
    assert "over-capacity" in exports_bar.get_attribute("class")
    assert "over by 1" in exports_bar.text
    assert "full" in rows[network.name].find_element(
        By.CSS_SELECTOR, ".semaphore-bar"
    ).get_attribute("class")
    # The admin's stylesheet was served: the page is laid out, not raw HTML.
    assert browser.find_element(By.ID, "header").value_of_css_property("display") == "flex"
    screenshot(browser, "admin-semaphore-changelist")

    # The usage filter, clicked in the sidebar.
    follow(browser, browser.find_element(By.LINK_TEXT, "over capacity"))
    listed = browser.find_elements(By.CSS_SELECTOR, "#result_list .field-name")
    assert [element.text for element in listed] == [exports.name]


def test_capacity_change_with_a_reason_appears_in_the_history(browser, server, holder):
    sem = Semaphore.objects.create(name=unique("exports"), capacity=4)
    fake_history(sem, [(20, 16, 2), (15, 14, 4), (9, 3, 3), (8, 7, 1)])
    process = holder({sem.name: 2})
    username = log_in(browser, server, "view_semaphore", "change_semaphore")

    browser.get(f"{server}/admin/django_semaphore/semaphore/{sem.pk}/change/")
    capacity = wait_for(browser, "#id_capacity")
    capacity.clear()
    capacity.send_keys("6")
    browser.find_element(By.ID, "id_reason").send_keys("Black Friday traffic")
    follow(browser, browser.find_element(By.NAME, "_continue"))

    wait_for(browser, ".messagelist .success")
    history = browser.find_element(By.ID, "history-group").text
    assert "4 → 6" in history
    assert username in history
    assert "Black Friday traffic" in history
    change = CapacityChange.objects.get(semaphore=sem)
    assert change.changed_by is not None
    assert change.changed_by.get_username() == username
    assert (change.old_capacity, change.new_capacity) == (4, 6)
    # The background process is listed among the holders, with its token.
    holders = browser.find_element(By.ID, "holders-group").text
    assert process.key in holders
    assert str(PermitRequest.objects.get(external_id=process.key).token(sem.name)) in holders
    # The chart was drawn by the server and rendered by the browser.
    chart = browser.find_element(By.CSS_SELECTOR, "svg.semaphore-utilization")
    assert chart.size["width"] > 600
    assert chart.find_elements(By.CSS_SELECTOR, "g.capacity-change")
    assert "Peak 4 in use" in chart.find_element(By.TAG_NAME, "desc").get_attribute("textContent")
    screenshot(browser, "admin-semaphore-page")


def test_window_change_with_a_reason_makes_a_rate_limit(browser, server, holder):
    sem = Semaphore.objects.create(name=unique("mirrors"), capacity=5)
    holder({sem.name: 2})
    username = log_in(browser, server, "view_semaphore", "change_semaphore")

    browser.get(f"{server}/admin/django_semaphore/semaphore/{sem.pk}/change/")
    wait_for(browser, "#id_window").send_keys("60")
    browser.find_element(By.ID, "id_reason").send_keys("Mirrors accept 5 syncs a minute")
    follow(browser, browser.find_element(By.NAME, "_continue"))

    wait_for(browser, ".messagelist .success")
    history = browser.find_element(By.ID, "history-group").text
    assert "5 → 5/min" in history
    assert username in history
    assert "Mirrors accept 5 syncs a minute" in history
    change = CapacityChange.objects.get(semaphore=sem)
    assert change.changed_by is not None
    assert change.changed_by.get_username() == username
    assert (change.old_window, change.new_window) == (None, 60)
    # A rate limit now: what was held before counts no more, a new grant does.
    acquire(sem.name, external_id=unique("job"))
    browser.refresh()
    wait_for(browser, ".field-next_slot")
    assert browser.find_element(By.CSS_SELECTOR, ".field-in_use .readonly").text == "1 in window"
    assert browser.find_element(By.CSS_SELECTOR, ".field-next_slot .readonly").text == "now"
    assert browser.find_element(By.ID, "id_window").get_attribute("value") == "60"
    screenshot(browser, "admin-rate-limit-page")

    browser.get(f"{server}/admin/django_semaphore/semaphore/?q={sem.name}")
    row = row_of(browser, sem.name)
    assert (cell(row, "rate"), cell(row, "in_use")) == ("5/min", "1 in window")
    screenshot(browser, "admin-rate-limit")


def test_force_release_a_holder(browser, server, holder):
    sem = Semaphore.objects.create(name=unique("backups"), capacity=2)
    stuck, other = holder({sem.name: 1}), holder({sem.name: 1})
    username = log_in(
        browser,
        server,
        "view_semaphore",
        "view_permitrequest",
        "force_release_permitrequest",
    )

    browser.get(f"{server}/admin/django_semaphore/semaphore/{sem.pk}/change/")
    wait_for(browser, "#holders-group")
    follow(browser, browser.find_element(By.PARTIAL_LINK_TEXT, "All holders"))
    row = row_of(browser, stuck.key)
    row.find_element(By.CSS_SELECTOR, "input.action-select").click()
    Select(browser.find_element(By.NAME, "action")).select_by_value("force_release")
    follow(browser, browser.find_element(By.CSS_SELECTOR, "button[name=index]"))

    message = wait_for(browser, ".messagelist .success").text
    assert message == "1 permit request was force-released."
    released = PermitRequest.objects.get(external_id=stuck.key)
    assert (released.state, released.release_reason) == (State.RELEASED, ReleaseReason.ADMIN)
    assert LogEntry.objects.get(object_id=str(released.pk)).user.get_username() == username
    # The worker learns it lost its permit; the other one still holds.
    assert stuck.ask("renew") == "lost"
    assert other.ask("renew") == "renewed"
    assert PermitRequest.objects.get(external_id=other.key).state == State.ACQUIRED
    # The list now shows only the other holder (it was filtered on ACQUIRED).
    keys = [
        e.text for e in browser.find_elements(By.CSS_SELECTOR, "#result_list .field-external_id")
    ]
    assert keys == [other.key]
    screenshot(browser, "admin-force-released")
