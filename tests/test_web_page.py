"""The web page at ``/`` in a real browser: headless Chromium from the system's packages
(``apt-get install chromium``), driven by Playwright, against the server on loopback (tiny model,
PyTorch LLM). The page loads and is usable without a mouse and on a phone-wide screen; a voice is
registered from a file and from the (fake) microphone; speech streams and plays, then stays in a
player, and what the page downloads is what the API gives for the same seed (pcm as a wav beside
its raw bytes); Stop frees the LLM sequence and says so without half-filled stats; each section
shows its own errors where its button is, in the page's words where the API's would mislead
(a voice gone, a voice that exists, the API key, which the page asks for at its top).

With "Captions" ticked the page calls /dev/captioned_speech: the sentences under the player, their SRT
and VTT, why words have no times; with a stand-in aligner, the sentence and word at the player's time
are marked and a sentence seeks there.

"Dialogue" sends its turns (a voice menu and a text each, added and removed from the keyboard) and the pause
to /v1/audio/dialogue and plays the answer as speech's; a refusal names the turn as the page counts turns and
marks its field (aria-invalid); on a phone each turn's text goes under its voice.

"Pronunciations" (lines as a lexicon file's) is every request's ``lexicon`` object, and no field when empty; a line
the page cannot read is named before anything is sent, the server's refusal of an entry with its line, the field
marked either way.

``COSYLLAMA_PAGE_SCREENSHOT=PATH`` also saves a screenshot of the page after a synthesis (docs/web-page.png),
``COSYLLAMA_CAPTIONS_SCREENSHOT=PATH`` one with captions, a word marked, ``COSYLLAMA_DIALOGUE_SCREENSHOT=PATH``
one of a dialogue spoken (and ``PATH`` with ``-phone`` before its suffix: the dialogue on a phone).
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import pytest

from helpers import FIXTURES, MODEL_DIR, slow_backend

CHROMIUM = Path("/usr/bin/chromium")
if not CHROMIUM.exists():
    pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium); the web page's browser tests need it",
                allow_module_level=True)
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
pytest.importorskip("playwright", reason="the web page's browser tests need playwright (the dev extra)")
from playwright.sync_api import expect, sync_playwright  # noqa: E402

from cosyllama.limits import RequestLimits  # noqa: E402
from cosyllama.server.app import create_app  # noqa: E402
from cosyllama.server.options import ServeOptions, ServingOptions  # noqa: E402
from cosyllama.server.wire import wav_header  # noqa: E402
from cosyllama.tts import TTS  # noqa: E402
from cosyllama.voices import VoiceStore  # noqa: E402
from helpers import LoopbackServer  # noqa: E402

PROMPT_WAV = FIXTURES / "wavs" / "prompt_en_16k.wav"
TRANSCRIPT = "Hello, this is my voice."
MAX_INPUT = 200
KEY = "page-key-0123456789"
# never a browser download, never the network: the system's Chromium, headless
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
FAKE_MIC = ["--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
            f"--use-file-for-fake-audio-capture={PROMPT_WAV}"]
WAIT_MS = 60_000  # generous: the machine may be busy
expect.set_options(timeout=WAIT_MS)  # for every expect(...), as page.set_default_timeout for the rest


@pytest.fixture(scope="module")
def tts():
    from cosyllama.tts import TTS

    t = TTS(MODEL_DIR, threads=1, precision="fp32")
    # create_app makes its scheduler over tts.llm
    return TTS.from_models(dataclasses.replace(t.models, llm=slow_backend(t.llm)))


def _serve(tts, **kw) -> LoopbackServer:
    view = TTS.from_models(tts.models, voices=VoiceStore())
    options = ServingOptions(view.options, limits=RequestLimits(input_chars=MAX_INPUT))
    app = create_app(view, ServeOptions(options, max_prompt_bytes=1_000_000, **kw))
    return LoopbackServer(app)


@pytest.fixture(scope="module")
def server(tts):
    srv = _serve(tts)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS + FAKE_MIC)
        yield b
        b.close()


@pytest.fixture
def page(browser, server):
    context = browser.new_context(accept_downloads=True)
    pg = context.new_page()
    pg.set_default_timeout(WAIT_MS)
    problems = []
    pg.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    pg.on("pageerror", lambda e: problems.append(str(e)))
    pg.problems = problems
    pg.goto(server.url + "/")
    yield pg
    context.close()


def _register(page, voice_id: str):
    page.set_input_files("#voice-file", str(PROMPT_WAV))
    page.fill("#voice-text", TRANSCRIPT)
    page.fill("#voice-id", voice_id)
    page.check("#voice-replace")
    _add(page, voice_id)


def _add(page, voice_id: str):
    """Press "Add voice" and wait for the answer; a refusal fails with the page's error text."""
    page.click("#add-voice")
    _wait_add(page)
    status = page.locator("#add-status").inner_text()
    assert status == f"Voice {voice_id} added", f"{status}: {page.locator('#add-error').inner_text()}"
    expect(page.locator("#voice")).to_have_value(voice_id)


def _wait_add(page):
    page.wait_for_function("() => document.getElementById('add-status').dataset.state !== 'busy'")


def _phone(browser):
    """A context as wide as a phone (390 px)."""
    context = browser.new_context(viewport={"width": 390, "height": 844}, accept_downloads=True)
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    return context, page


def _stats(page) -> dict:
    """The stats row as shown: label -> value, for the labels one sees."""
    return page.evaluate("""() => Object.fromEntries([...document.querySelectorAll('#stats > div')]
        .filter(d => d.checkVisibility()).map(d => [d.querySelector('dt').textContent,
                                                    d.querySelector('dd').textContent]))""")


def _post_voice(url: str, voice_id: str, **data):
    r = httpx.post(f"{url}/v1/voices", files={"audio": ("p.wav", PROMPT_WAV.read_bytes(), "audio/wav")},
                   data={"id": voice_id, "replace": "true", **data}, timeout=60)
    assert r.status_code == 200, r.text


def _state(page) -> str:
    return page.locator("#status").get_attribute("data-state")


def _wait_health(url: str, ok, what: str, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = httpx.get(f"{url}/health", timeout=10).json()
        if ok(h):
            return h
        assert time.monotonic() < deadline, f"{what}: {h}"
        time.sleep(0.02)


def test_the_page_loads_with_labels_and_fits_a_phone(browser, server):
    context = browser.new_context(viewport={"width": 360, "height": 740})
    try:
        page = context.new_page()
        errors = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        resp = page.goto(server.url + "/")
        assert resp.status == 200 and page.title() == "cosyllama"
        expect(page.locator("h1")).to_have_text("cosyllama")
        expect(page.locator("#voice option")).to_have_count(1)  # the voices were listed (none yet, or some)
        unlabelled = page.evaluate("""() => [...document.querySelectorAll('input, select, textarea')]
            .filter(e => e.type !== 'hidden' && !e.labels.length).map(e => e.id || e.outerHTML)""")
        assert unlabelled == []
        assert page.evaluate("document.documentElement.scrollWidth") <= 360  # no sideways scrolling
        page.click("#lexicon-box summary")  # Pronunciations, opened: it fits too
        expect(page.locator("#lexicon")).to_be_visible()
        assert page.evaluate("document.documentElement.scrollWidth") <= 360
        page.keyboard.press("Tab")  # keyboard: the first stop is a control of the page
        assert page.evaluate("document.activeElement.tagName") in ("A", "TEXTAREA", "INPUT", "SELECT", "BUTTON")
        assert errors == []  # also: nothing the page's Content-Security-Policy refused
    finally:
        context.close()


def test_register_speak_play_and_download_what_the_api_gives(page, server):
    _register(page, "anna")
    voices = {v["id"]: v for v in httpx.get(f"{server.url}/v1/voices").json()["voices"]}
    assert voices["anna"]["has_transcript"]
    page.fill("#text", "Hello there, this is a test.")
    page.fill("#seed", "7")
    page.select_option("#format", "wav")
    page.focus("#text")
    page.keyboard.press("Control+Enter")  # no mouse needed
    expect(page.locator("#status")).to_have_attribute("data-state", "playing")
    assert page.evaluate("window.cosyllamaPage.audioState") == "running"
    assert page.evaluate("window.cosyllamaPage.scheduled") >= 1
    expect(page.locator("#download")).to_be_visible()
    for stat in ("#stat-first", "#stat-length", "#stat-rtf"):
        assert page.locator(stat).inner_text().strip() not in ("", "?", "none")
    assert page.locator("#stat-seed").inner_text() == "7"
    with page.expect_download() as dl:
        page.click("#download")
    assert dl.value.suggested_filename == "speech-anna-7.wav"
    got = Path(dl.value.path()).read_bytes()
    expect(page.locator("#player")).to_be_visible()  # the streamed speech, to play again
    page.wait_for_function("() => document.getElementById('player').duration > 2.9")
    api = httpx.post(f"{server.url}/v1/audio/speech", timeout=60, json={
        "input": "Hello there, this is a test.", "voice": "anna", "seed": 7, "response_format": "wav",
        "greedy": False, "stream_format": "audio"}).content
    assert len(api) > 44 + 2400
    assert got[44:] == api[44:]  # the same samples
    assert got[:44] == wav_header(24_000, len(api) - 44)  # with the real sizes in place of the stream's
    if os.environ.get("COSYLLAMA_PAGE_SCREENSHOT"):
        page.screenshot(path=os.environ["COSYLLAMA_PAGE_SCREENSHOT"], full_page=True)
    assert page.problems == []


def test_a_whole_file_format_downloads_the_apis_bytes(page, server):
    _register(page, "anna")
    page.fill("#text", "One more sentence.")
    page.fill("#seed", "3")
    page.check("#greedy")
    page.select_option("#format", "flac")
    page.click("#speak")
    expect(page.locator("#download")).to_be_visible()
    with page.expect_download() as dl:
        page.click("#download")
    assert dl.value.suggested_filename == "speech-anna-3.flac"
    api = httpx.post(f"{server.url}/v1/audio/speech", timeout=60, json={
        "input": "One more sentence.", "voice": "anna", "seed": 3, "response_format": "flac", "greedy": True})
    assert Path(dl.value.path()).read_bytes() == api.content
    expect(page.locator("#stat-length")).not_to_have_text("?")
    expect(page.locator("#download-raw")).to_be_hidden()


def test_streamed_pcm_stays_in_a_player_and_downloads_as_wav(page, server):
    """pcm streams through Web Audio; when it ends the page holds it as a wav: in a player and as
    the download (named .wav), with the raw pcm offered beside it; both the API's samples."""
    _register(page, "anna")
    page.fill("#text", "Short one.")
    page.fill("#seed", "5")
    page.check("#greedy")
    page.select_option("#format", "pcm")
    page.click("#speak")
    expect(page.locator("#download")).to_be_visible()
    expect(page.locator("#player")).to_be_visible()
    page.wait_for_function("() => document.getElementById('player').duration > 0")  # it is a file it can play
    with page.expect_download() as dl:
        page.click("#download")
    assert dl.value.suggested_filename == "speech-anna-5.wav"
    wav = Path(dl.value.path()).read_bytes()
    with page.expect_download() as dl:
        page.click("#download-raw")
    assert dl.value.suggested_filename == "speech-anna-5.pcm"
    raw = Path(dl.value.path()).read_bytes()
    api = httpx.post(f"{server.url}/v1/audio/speech", timeout=60, json={
        "input": "Short one.", "voice": "anna", "seed": 5, "response_format": "pcm", "greedy": True,
        "stream_format": "audio"}).content
    assert len(api) > 2400 and raw == api
    assert wav == wav_header(24_000, len(api)) + api
    assert page.problems == []


def test_stop_frees_the_sequence(page, server, tts):
    _register(page, "anna")
    page.fill("#text", "A long sentence that keeps the model busy for a good while, one word after another word.")
    tts.llm.step_delay = 0.02  # ~500 decode steps: about 10 s
    try:
        page.click("#speak")
        expect(page.locator("#status")).to_have_attribute("data-state", "playing")
        _wait_health(server.url, lambda h: h["active_sequences"] == 1, "the request is not decoding")
        page.click("#stop")
        cut = time.monotonic()
        _wait_health(server.url, lambda h: h["active_sequences"] == 0 and h["requests_running"] == 0,
                     "Stop did not free the sequence", timeout=5)
        assert time.monotonic() - cut < 5
    finally:
        tts.llm.step_delay = 0.0
    expect(page.locator("#status")).to_have_attribute("data-state", "stopped")
    expect(page.locator("#status")).to_contain_text("Stopped after")  # how much audio had arrived
    expect(page.locator("#speak")).to_be_enabled()
    stats = _stats(page)  # no label without its value; no length or RTF for speech cut short
    assert "Audio" not in stats and "RTF" not in stats, stats
    assert stats["First audio"].endswith(" s") and "Seed" in stats, stats
    assert all(v.strip() for v in stats.values()), stats
    expect(page.locator("#download")).to_be_hidden()
    assert page.problems == []


def test_the_servers_refusals_are_shown_in_its_words(page, server):
    _register(page, "anna")
    page.fill("#text", "x" * (MAX_INPUT + 50))
    page.click("#speak")
    error = page.locator("#error")
    expect(error).to_be_visible()
    text = error.inner_text()
    assert text.startswith("413")
    assert f"input is too long: {MAX_INPUT + 50} characters, at most {MAX_INPUT} allowed (--max-input-chars)" in text
    assert _state(page) == "error"
    # a voice clip the server cannot read: its 400, word for word, in the Add a voice section
    page.set_input_files("#voice-file", {"name": "notes.wav", "mimeType": "audio/wav", "buffer": b"just text"})
    page.click("#add-voice")
    add_error = page.locator("#add-error")
    expect(add_error).to_contain_text("400")
    expect(add_error).to_contain_text("prompt audio is not a readable audio file")
    assert text == error.inner_text()  # the speech's error stays the speech's


def test_a_voice_recorded_from_the_microphone(page, server):
    """The fake microphone plays the prompt clip; the page records it with MediaRecorder and sends
    it as a wav the server reads."""
    page.click("#record")
    page.wait_for_function("() => Number(document.getElementById('record-status').dataset.seconds || 0) >= 2.5")
    page.click("#record")
    expect(page.locator("#record-status")).to_have_attribute("data-state", "recorded")
    page.fill("#voice-id", "mic")
    page.check("#voice-replace")
    _add(page, "mic")
    voices = {v["id"]: v for v in httpx.get(f"{server.url}/v1/voices").json()["voices"]}
    assert voices["mic"]["seconds"] > 1.0 and not voices["mic"]["has_transcript"]
    page.on("dialog", lambda d: d.accept())
    page.click("#delete-voice")  # the selected voice: mic
    expect(page.locator("#voices-status")).to_have_text("Voice mic deleted")
    assert "mic" not in [v["id"] for v in httpx.get(f"{server.url}/v1/voices").json()["voices"]]


def test_add_voice_speaks_in_its_own_section_and_clears_its_form(browser, server):
    """On a phone: the answer to "Add voice" (a refusal, a success) shows under its button, in view;
    after a success the form is empty, so a second click sends nothing twice (no 409); a 409 for
    an id taken is worded for the page (its checkbox), not the API (replace=true)."""
    context, page = _phone(browser)
    try:
        page.goto(server.url + "/")
        page.set_input_files("#voice-file", {"name": "n.wav", "mimeType": "audio/wav", "buffer": b"just text"})
        page.click("#add-voice")
        add_error = page.locator("#add-error")
        expect(add_error).to_contain_text("prompt audio is not a readable audio file")
        expect(add_error).to_be_in_viewport(ratio=0.99)  # the whole box (but rounding), without scrolling
        expect(page.locator("#error")).to_be_hidden()
        _register(page, "form")
        expect(add_error).to_be_hidden()
        expect(page.locator("#add-status")).to_be_in_viewport()
        assert page.evaluate("document.getElementById('voice-file').files.length") == 0
        for field in ("#voice-id", "#voice-text"):
            expect(page.locator(field)).to_have_value("")
        expect(page.locator("#voice-replace")).not_to_be_checked()
        page.click("#add-voice")  # again: nothing to send
        expect(add_error).to_have_text("Choose an audio file or record one first.")
        page.set_input_files("#voice-file", str(PROMPT_WAV))
        page.fill("#voice-id", "form")
        page.click("#add-voice")  # an id taken, without "Replace"
        expect(add_error).to_contain_text('A voice form exists already: tick "Replace a voice of this id"')
        assert "replace=true" not in add_error.inner_text()
    finally:
        context.close()


def test_a_voice_deleted_elsewhere_leaves_the_menu(page, server):
    """A voice deleted by another client: Speak and Delete get a 404; the page says so in its own
    words (not the API's "POST /v1/voices") and refreshes the menu."""
    _post_voice(server.url, "gone")
    _post_voice(server.url, "gone2")
    page.click("#refresh-voices")
    expect(page.locator("#voice option[value='gone2']")).to_have_count(1)
    page.select_option("#voice", "gone")
    assert httpx.delete(f"{server.url}/v1/voices/gone").status_code == 200
    assert httpx.delete(f"{server.url}/v1/voices/gone2").status_code == 200
    page.click("#speak")
    error = page.locator("#error")
    expect(error).to_contain_text("The voice gone is no longer on the server")
    assert "POST /v1/voices" not in error.inner_text()
    expect(page.locator("#voice option[value='gone']")).to_have_count(0)
    expect(page.locator("#voice option[value='gone2']")).to_have_count(0)
    # the menu as it was before the refresh: Delete meets the 404
    page.evaluate("""() => { const o = document.createElement('option'); o.value = 'gone2';
        o.textContent = 'gone2'; document.getElementById('voice').append(o); }""")
    page.select_option("#voice", "gone2")
    page.on("dialog", lambda d: d.accept())
    page.click("#delete-voice")
    expect(page.locator("#voices-status")).to_contain_text("The voice gone2 was already gone")
    expect(page.locator("#voices-error")).to_be_hidden()
    expect(page.locator("#voice option[value='gone2']")).to_have_count(0)
    assert [p for p in page.problems if "status of 404" not in p] == []  # the browser logs each 404


def test_the_voice_row_fits_a_phone(browser, server):
    """390 px: the voice menu shows its whole label, Refresh and Delete share a line."""
    _post_voice(server.url, "anna", text=TRANSCRIPT)  # its label: "anna (2.0 s, transcript)"
    context, page = _phone(browser)
    try:
        page.goto(server.url + "/")
        page.select_option("#voice", "anna")
        fit = page.evaluate("""() => { const s = document.getElementById('voice'), cs = getComputedStyle(s);
            const c = document.createElement('canvas').getContext('2d'); c.font = cs.font;
            return { text: c.measureText(s.selectedOptions[0].textContent).width,
                     room: s.clientWidth - parseFloat(cs.paddingLeft) - parseFloat(cs.paddingRight) - 24 }; }""")
        boxes = {b: page.locator(b).bounding_box() for b in ("#voice", "#refresh-voices", "#delete-voice")}
        assert fit["text"] <= fit["room"], fit  # the label is not cut (24 px: the menu's arrow)
        assert boxes["#refresh-voices"]["y"] == boxes["#delete-voice"]["y"], boxes  # Delete does not wrap alone
        assert page.evaluate("document.documentElement.scrollWidth") <= 390
    finally:
        context.close()


def test_an_api_key_typed_into_the_page(browser, tts):
    """With --api-key the page opens asking for the key at its top (on a phone too), in its own
    words: no red 401, no talk of SDKs; a wrong key is said to be wrong; the right one is kept."""
    srv = _serve(tts, api_key=KEY)
    context, page = _phone(browser)
    try:
        page.goto(srv.url + "/")  # the page itself loads without the key
        section = page.locator("#key-section")
        expect(section).to_be_visible()
        expect(section).to_be_in_viewport()
        expect(page.locator("#key-message")).to_contain_text("This server needs an API key")
        expect(page.locator("#api-key")).to_be_focused()
        body = page.locator("body").inner_text()
        assert "401" not in body and "SDK" not in body
        expect(page.locator("#error")).to_be_hidden()
        expect(page.locator("#voices-error")).to_be_hidden()
        page.keyboard.type("wrong-key-0123456789")
        page.keyboard.press("Enter")
        expect(page.locator("#key-message")).to_contain_text("did not accept this API key")
        page.fill("#api-key", KEY)
        page.press("#api-key", "Enter")
        expect(page.locator("#key-message")).to_have_text("Key accepted.")
        assert page.evaluate("sessionStorage.getItem('cosyllama.apiKey')") == KEY
        _register(page, "keyed")  # a POST with the key, from the server's own origin
        page.reload()  # the key stays for this tab's session
        assert page.input_value("#api-key") == KEY
        expect(page.locator("#voice")).to_have_value("keyed")
        expect(page.locator("#error")).to_be_hidden()
    finally:
        context.close()
        srv.stop()


def _speak_with_captions(page, seed: int, path: str):
    """Speak what the page holds (wav, `seed`) with "Captions" on; the response of `path`, once the page shows its
    audio in its player."""
    page.fill("#seed", str(seed))
    page.select_option("#format", "wav")
    page.check("#captions")
    expect(page.locator("#stream")).to_be_disabled()  # the whole file: not streamed
    with page.expect_response(lambda r: r.url.endswith(path)) as resp:
        page.click("#speak")
    assert resp.value.status == 200, resp.value.text()
    page.wait_for_function("() => document.getElementById('player').duration > 0")
    return resp.value


def _speak_captioned(page, text: str, seed: int) -> dict:
    """Speak `text` with "Captions" on; the answer of /dev/captioned_speech, once the page shows it in its player."""
    page.fill("#text", text)
    return _speak_with_captions(page, seed, "/dev/captioned_speech").json()


def _download(page, selector: str) -> tuple[str, str]:
    with page.expect_download() as dl:
        page.click(selector)
    return dl.value.suggested_filename, Path(dl.value.path()).read_text(encoding="utf-8")


def test_captions_show_each_sentence_their_files_and_why_words_are_missing(page, server, monkeypatch):
    """With "Captions" the page asks /dev/captioned_speech for the whole file, plays it in its player and
    lists the sentences under it, with SRT and VTT downloads; where no word aligns (here an aligner that
    always refuses: the tiny model speaks noise, which may or may not align) the page says why, in the
    server's words. Unticked, Speak streams again."""
    import cosyllama.alignment as alignment

    def refuse(*args, **kwargs):
        raise alignment.AlignError("the text does not match the audio (a stand-in aligner)")

    monkeypatch.setattr(alignment, "align", refuse)  # what WordTimer calls, at call time
    _register(page, "anna")
    expect(page.locator("#caption-area")).to_be_hidden()
    answer = _speak_captioned(page, "Hello there. This is a test of captions.", 7)
    area = page.get_by_role("region", name="Captions")
    expect(area).to_be_visible()
    segments = answer["segments"]
    lines = area.locator(".caption-line")
    expect(lines).to_have_count(len(segments))
    for line, seg in zip(lines.all(), segments):
        expect(line).to_contain_text(seg["text"])
    assert all(seg["words"] is None and seg["words_why"] for seg in segments), segments
    why = "; ".join(dict.fromkeys(seg["words_why"] for seg in segments))
    expect(page.locator("#caption-note")).to_have_text(f"No word times: {why}")
    expect(area.locator(".caption-word")).to_have_count(0)
    expect(page.locator("#player")).to_be_visible()
    expect(page.locator("#download")).to_be_visible()
    assert page.locator("#stat-seed").inner_text() == "7"
    name, srt = _download(page, "#caption-srt")
    assert name == "speech-anna-7.srt" and srt == answer["srt"]
    assert srt.startswith("1\n00:00:00,000 --> ") and segments[0]["text"] in srt
    name, vtt = _download(page, "#caption-vtt")
    assert name == "speech-anna-7.vtt" and vtt == answer["vtt"]
    assert vtt.startswith("WEBVTT\n\n00:00:00.000 --> ") and segments[0]["text"] in vtt

    page.uncheck("#captions")  # the old path: /v1/audio/speech, streamed through Web Audio
    expect(page.locator("#stream")).to_be_enabled()
    with page.expect_request(lambda r: r.url.endswith("/v1/audio/speech")) as req:
        page.click("#speak")
    assert req.value.post_data_json["stream_format"] == "audio"
    expect(page.locator("#status")).to_have_attribute("data-state", "playing")
    assert page.evaluate("window.cosyllamaPage.scheduled") >= 1
    expect(page.locator("#caption-area")).to_be_hidden()
    assert page.problems == []


# two segments (the frontend cuts at 60-80 tokens), under MAX_INPUT characters
TWO_SENTENCES = ("One. Two three. Four five six seven eight nine ten eleven twelve. Thirteen fourteen fifteen sixteen "
                 "seventeen eighteen nineteen twenty. Twenty-one twenty-two twenty-three twenty-four. Done now.")


def _even_words(module):
    """A stand-in for the aligner: the text's words spread evenly over the audio."""
    from cosyllama.captions import Word

    def align(audio, sample_rate, text, language=None, **kw):
        words = text.split()
        step = len(audio) / sample_rate / len(words)
        return module.Alignment(words=tuple(Word(w, round(i * step, 3), round((i + 1) * step, 3))
                                            for i, w in enumerate(words)), language="en", seconds=0.0)

    return align


def _at(page, t: float):
    page.evaluate("t => { const a = document.getElementById('player'); a.pause(); a.currentTime = t; }", t)


def test_captions_follow_the_player_word_by_word(page, server, monkeypatch):
    """Word times (a stand-in aligner, in this process's server): the sentence and the word at the player's
    time are marked (aria-current and the highlight); a sentence, clicked or pressed with Enter, plays from
    its start."""
    from cosyllama import alignment

    monkeypatch.setattr(alignment, "align", _even_words(alignment))  # what WordTimer calls, at call time
    assert len(TWO_SENTENCES) <= MAX_INPUT
    _register(page, "anna")
    answer = _speak_captioned(page, TWO_SENTENCES, 11)
    segments = answer["segments"]
    assert len(segments) == 2 and all(seg["words"] for seg in segments), segments
    area = page.get_by_role("region", name="Captions")
    lines = area.locator(".caption-line")
    expect(lines).to_have_count(2)
    expect(page.locator("#caption-note")).to_be_hidden()
    for line, seg in zip(lines.all(), segments):
        expect(line.locator(".caption-word")).to_have_count(len(seg["words"]))
        expect(line).to_contain_text(seg["text"])
    marked = area.locator("[aria-current]")
    for i, k in ((0, 0), (0, 3), (1, -1), (1, 2)):
        words = segments[i]["words"]
        k %= len(words)
        w = words[k]
        _at(page, (w["start"] + w["end"]) / 2)
        word = lines.nth(i).locator(".caption-word").nth(k)
        expect(word).to_have_attribute("aria-current", "true")
        expect(word).to_have_class("caption-word current")
        expect(word).to_have_text(w["word"])
        expect(lines.nth(i)).to_have_attribute("aria-current", "true")
        expect(marked).to_have_count(2)  # that sentence and that word, nothing else
    if os.environ.get("COSYLLAMA_CAPTIONS_SCREENSHOT"):  # the last word marked: (1, 2)
        page.screenshot(path=os.environ["COSYLLAMA_CAPTIONS_SCREENSHOT"], full_page=True)
    assert segments[1]["start"] > 1.0
    _at(page, 0.0)
    lines.nth(1).click()  # plays from the second sentence
    page.wait_for_function(f"() => document.getElementById('player').currentTime >= {segments[1]['start']}")
    expect(lines.nth(1)).to_have_attribute("aria-current", "true")
    _at(page, segments[1]["start"] + 0.01)
    expect(lines.nth(0)).not_to_have_attribute("aria-current", "true")
    lines.nth(0).focus()  # the keyboard: Enter on a sentence
    page.keyboard.press("Enter")
    page.wait_for_function(f"() => document.getElementById('player').currentTime < {segments[1]['start']}")
    expect(lines.nth(0)).to_have_attribute("aria-current", "true")
    page.evaluate("document.getElementById('player').pause()")
    assert page.problems == []


# -- dialogue -----------------------------------------------------------------------------------

DIALOGUE_PATH = "/v1/audio/dialogue"
TURNS = [("anna", "Good morning! Did you sleep well?"), ("bob", "Not really.")]


def _dialogue(page, server):
    """Two voices on the server, listed by the page, and the page in "Dialogue": its turn rows."""
    _post_voice(server.url, "anna", text=TRANSCRIPT)
    _post_voice(server.url, "bob")
    page.click("#refresh-voices")
    expect(page.locator("#voice option[value='bob']")).to_have_count(1)
    page.get_by_label("Dialogue", exact=True).check()
    expect(page.locator("#dialogue")).to_be_visible()
    expect(page.locator("#text")).to_be_hidden()
    rows = page.locator("#turns > li")
    expect(rows).to_have_count(2)  # a dialogue to start from
    for k, (voice, text) in enumerate(TURNS, 1):
        page.get_by_label(f"Turn {k} voice").select_option(voice)
        page.get_by_label(f"Turn {k} text").fill(text)
    return rows


def test_a_dialogue_sends_its_turns_and_plays_them(page, server):
    """Turns added and removed from the keyboard; Speak sends the turns, the pause and the page's options to
    /v1/audio/dialogue, streams the answer through Web Audio and downloads the API's samples."""
    rows = _dialogue(page, server)
    expect(page.get_by_role("button", name="Remove turn 1")).to_be_enabled()
    expect(page.locator("#captions")).not_to_be_checked()  # offered, off: the turns stream
    page.focus("#add-turn")
    page.keyboard.press("Enter")
    expect(rows).to_have_count(3)
    expect(page.get_by_label("Turn 3 text")).to_be_focused()  # type the new turn's words at once
    expect(page.get_by_label("Turn 3 voice")).to_have_value("anna")  # the speakers alternate
    page.keyboard.type("A turn too many.")
    page.get_by_role("button", name="Remove turn 3").focus()
    page.keyboard.press("Enter")
    expect(rows).to_have_count(2)
    expect(page.get_by_role("button", name="Remove turn 2")).to_be_focused()  # the focus stays in the list
    expect(page.locator("#pause")).to_have_value("0.4")
    page.fill("#pause", "0.3")
    page.fill("#seed", "7")
    page.select_option("#format", "wav")
    expect(page.locator("#stream")).to_be_checked()
    page.get_by_label("Turn 2 text").focus()
    with page.expect_request(lambda r: r.url.endswith(DIALOGUE_PATH)) as req:
        page.keyboard.press("Control+Enter")
    sent = req.value.post_data_json
    assert sent == {"turns": [{"voice": v, "text": t} for v, t in TURNS], "pause_between_turns": 0.3,
                    "response_format": "wav", "greedy": False, "seed": 7, "stream_format": "audio"}, sent
    expect(page.locator("#status")).to_have_attribute("data-state", "playing")
    assert page.evaluate("window.cosyllamaPage.scheduled") >= 1
    expect(page.locator("#download")).to_be_visible()
    assert page.locator("#stat-seed").inner_text() == "7"
    with page.expect_download() as dl:
        page.click("#download")
    assert dl.value.suggested_filename == "dialogue-7.wav"
    got = Path(dl.value.path()).read_bytes()
    api = httpx.post(server.url + DIALOGUE_PATH, json=sent, timeout=60).content
    assert len(api) > 44 + 2 * int(0.3 * 24_000)  # the pause at least
    assert got == wav_header(24_000, len(api) - 44) + api[44:]  # the API's samples, with their real sizes
    expect(page.locator("#player")).to_be_visible()
    expect(page.locator("#error")).to_be_hidden()
    if os.environ.get("COSYLLAMA_DIALOGUE_SCREENSHOT"):
        page.screenshot(path=os.environ["COSYLLAMA_DIALOGUE_SCREENSHOT"], full_page=True)
    page.get_by_label("One text", exact=True).check()  # back: the one text, its voice menu, /v1/audio/speech
    expect(page.locator("#text")).to_be_visible()
    expect(page.locator("#dialogue")).to_be_hidden()
    assert page.problems == []


def test_a_dialogues_captions_name_each_speaker(page, server, monkeypatch):
    """"Captions" in "Dialogue" asks /dev/captioned_dialogue for the whole file (the turns, the pause, not
    streamed), plays it, lists each sentence with its speaker and word spans, and downloads the SRT and VTT
    that name the speakers ([anna], <v anna>)."""
    from cosyllama import alignment

    monkeypatch.setattr(alignment, "align", _even_words(alignment))  # what WordTimer calls, at call time
    _dialogue(page, server)
    page.fill("#pause", "0.3")
    resp = _speak_with_captions(page, 5, "/dev/captioned_dialogue")
    sent = resp.request.post_data_json
    assert sent["turns"] == [{"voice": v, "text": t} for v, t in TURNS] and sent["pause_between_turns"] == 0.3
    assert sent["stream"] is False and sent["return_timestamps"] is True and "stream_format" not in sent
    answer = resp.json()
    segments = answer["segments"]
    assert [seg["voice"] for seg in segments][0] == "anna" and segments[-1]["voice"] == "bob", segments
    area = page.get_by_role("region", name="Captions")
    lines = area.locator(".caption-line")
    expect(lines).to_have_count(len(segments))
    for line, seg in zip(lines.all(), segments):
        expect(line.locator(".caption-voice")).to_have_text(seg["voice"])
        expect(line).to_contain_text(seg["text"])
        expect(line.locator(".caption-word")).to_have_count(len(seg["words"]))
    name, srt = _download(page, "#caption-srt")
    assert name == "dialogue-5.srt" and srt == answer["srt"] and "[anna]" in srt and "[bob]" in srt
    name, vtt = _download(page, "#caption-vtt")
    assert name == "dialogue-5.vtt" and vtt == answer["vtt"] and "<v anna>" in vtt and "<v bob>" in vtt
    expect(page.locator("#error")).to_be_hidden()
    if os.environ.get("COSYLLAMA_DIALOGUE_SCREENSHOT"):
        page.screenshot(path=os.environ["COSYLLAMA_DIALOGUE_SCREENSHOT"].replace(".png", "-captions.png"),
                        full_page=True)
    page.uncheck("#captions")  # back to the streamed dialogue
    expect(page.locator("#stream")).to_be_enabled()
    with page.expect_request(lambda r: r.url.endswith(DIALOGUE_PATH)) as req:
        page.click("#speak")
    assert req.value.post_data_json["stream_format"] == "audio"
    expect(page.locator("#caption-area")).to_be_hidden()
    assert page.problems == []


def test_a_refused_dialogue_names_its_turn_and_marks_it(page, server):
    """The server's refusal in the error area, its turn counted as the page counts (Turn 2, not turns[1]),
    and that turn's voice or text marked aria-invalid until it is changed."""
    _dialogue(page, server)
    voice2, text1 = page.get_by_label("Turn 2 voice"), page.get_by_label("Turn 1 text")
    page.evaluate("""() => { const o = document.createElement('option'); o.value = 'zed'; o.textContent = 'zed';
        document.getElementById('turns').children[1].querySelector('select').append(o); }""")
    voice2.select_option("zed")  # a voice deleted since the menu was filled
    page.click("#speak")
    error = page.locator("#error")
    expect(error).to_contain_text("Turn 2 (zed)")
    assert error.inner_text().startswith("404") and "turns[1]" not in error.inner_text()
    assert "POST /v1/voices" not in error.inner_text()  # in the page's words: a voice is added below
    assert _state(page) == "error"
    expect(voice2).to_have_attribute("aria-invalid", "true")
    expect(voice2).to_have_attribute("aria-describedby", "error")
    expect(page.locator("#dialogue [aria-invalid]")).to_have_count(1)
    voice2.select_option("bob")  # changed: no longer marked
    expect(voice2).not_to_have_attribute("aria-invalid", "true")
    text1.fill("  ")
    page.click("#speak")
    expect(error).to_contain_text("Turn 1 (anna) has no text")
    assert error.inner_text().startswith("422")
    expect(text1).to_have_attribute("aria-invalid", "true")
    expect(page.locator("#dialogue [aria-invalid]")).to_have_count(1)
    expect(page.locator("#download")).to_be_hidden()
    assert [p for p in page.problems if "status of 40" not in p and "status of 42" not in p] == []


def test_the_dialogue_fits_a_phone(browser, server):
    """390 px: a turn's number, voice and Remove on one line, its text under them; nothing scrolls sideways."""
    _post_voice(server.url, "anna", text=TRANSCRIPT)
    _post_voice(server.url, "bob")
    context, page = _phone(browser)
    try:
        page.goto(server.url + "/")
        page.get_by_label("Dialogue", exact=True).check()
        expect(page.get_by_label("Turn 2 voice")).not_to_have_value("")
        assert page.get_by_label("Turn 1 voice").input_value() != page.get_by_label("Turn 2 voice").input_value()
        box = {name: page.get_by_label(f"Turn 1 {name}").bounding_box() for name in ("voice", "text")}
        remove = page.get_by_role("button", name="Remove turn 1").bounding_box()
        assert remove["y"] == box["voice"]["y"] and remove["x"] > box["voice"]["x"], (remove, box)
        assert box["text"]["y"] >= box["voice"]["y"] + box["voice"]["height"], box
        assert page.evaluate("document.documentElement.scrollWidth") <= 390
        unlabelled = page.evaluate("""() => [...document.querySelectorAll('#dialogue :is(input, select, textarea)')]
            .filter(e => !e.labels.length).map(e => e.id)""")
        assert unlabelled == []
        if os.environ.get("COSYLLAMA_DIALOGUE_SCREENSHOT"):
            path = Path(os.environ["COSYLLAMA_DIALOGUE_SCREENSHOT"])
            page.screenshot(path=str(path.with_stem(path.stem + "-phone")), full_page=True)
    finally:
        context.close()


# -- pronunciations: the lexicon field --------------------------------------------------------------

LEXICON_LINES = "# comments and blank lines are skipped\ntomato\t[T][AH0][M][EY1][T][OW2]\n\n几 [j][ǐ]  # a comment\n" \
    "New York\t[N][UW1] [Y][AO1][R][K]\n"
LEXICON = {"tomato": "[T][AH0][M][EY1][T][OW2]", "几": "[j][ǐ]", "New York": "[N][UW1] [Y][AO1][R][K]"}


def _pronunciations(page, lines: str):
    if not page.locator("#lexicon").is_visible():
        page.click("#lexicon-box summary")  # the <details> opened
    page.get_by_label("Words and their pronunciation tokens").fill(lines)


def test_pronunciations_go_with_every_request(page, server):
    """The Pronunciations field, read as a lexicon file, is the request's lexicon object for speech,
    captioned speech and a dialogue (the server speaks it: 200); empty, no lexicon field is sent."""
    _dialogue(page, server)
    page.get_by_label("One text", exact=True).check()
    page.select_option("#voice", "anna")
    page.fill("#text", "A tomato.")
    page.fill("#seed", "7")
    page.check("#greedy")
    with page.expect_request(lambda r: r.url.endswith("/v1/audio/speech")) as req:
        page.click("#speak")
    assert "lexicon" not in req.value.post_data_json  # empty: the request as before
    page.click("#stop")
    _pronunciations(page, LEXICON_LINES)
    expect(page.locator("#lexicon-count")).to_have_text("(3 entries)")
    with page.expect_response(lambda r: r.url.endswith("/v1/audio/speech")) as resp:
        page.click("#speak")
    assert resp.value.request.post_data_json["lexicon"] == LEXICON
    assert resp.value.status == 200
    page.click("#stop")
    page.check("#captions")
    with page.expect_request(lambda r: r.url.endswith("/dev/captioned_speech")) as req:
        page.click("#speak")
    assert req.value.post_data_json["lexicon"] == LEXICON
    page.click("#stop")
    page.get_by_label("Dialogue", exact=True).check()
    expect(page.locator("#lexicon")).to_be_visible()  # the same field in both modes
    expect(page.locator("#captions")).to_be_checked()  # kept across modes: a captioned dialogue
    with page.expect_request(lambda r: r.url.endswith("/dev/captioned_dialogue")) as req:
        page.click("#speak")
    assert req.value.post_data_json["lexicon"] == LEXICON
    page.click("#stop")
    page.uncheck("#captions")
    with page.expect_request(lambda r: r.url.endswith(DIALOGUE_PATH)) as req:
        page.click("#speak")
    assert req.value.post_data_json["lexicon"] == LEXICON
    page.click("#stop")
    expect(page.locator("#error")).to_be_hidden()
    assert page.problems == []


def test_a_pronunciation_line_the_page_cannot_read_is_named_before_sending(page, server):
    """A line without tokens, or with tokens out of their brackets: said on the page with its line, the field
    marked (its hint still describing it) until it is edited, and nothing sent."""
    _post_voice(server.url, "anna", text=TRANSCRIPT)
    page.click("#refresh-voices")
    expect(page.locator("#voice")).to_have_value("anna")
    sent = []
    page.on("request", lambda r: sent.append(r.url) if r.method == "POST" else None)
    field, error = page.locator("#lexicon"), page.locator("#error")
    for lines, words in (("tomato\t[T][AH0][M][EY1][T][OW2]\npotato T AH0 T\n",
                          'Pronunciations, line 2 ("potato"): "T AH0 T" is not in brackets'),
                         ("\n# a comment\ntomato\n", 'Pronunciations, line 3 ("tomato"): no tokens'),
                         ("tomato [T]\nTomato [T]", 'line 2 ("Tomato"): the word is on line 1 already')):
        _pronunciations(page, lines)
        page.click("#speak")
        expect(error).to_contain_text(words)
        expect(field).to_have_attribute("aria-invalid", "true")
        expect(field).to_have_attribute("aria-describedby", "error lexicon-hint")
        expect(field).to_be_focused()
    page.locator("#lexicon-box summary").click()  # closed: a refusal opens it again
    expect(field).to_be_hidden()
    page.click("#speak")
    expect(field).to_be_visible()
    field.press("End")
    page.keyboard.type(" ")  # an edit: no longer marked
    expect(field).not_to_have_attribute("aria-invalid", "true")
    expect(field).to_have_attribute("aria-describedby", "lexicon-hint")
    assert sent == []
    assert page.problems == []


def test_the_servers_refusal_of_a_pronunciation_marks_the_field(page, server):
    """A token the model does not have: the server's 422 (param lexicon) in the error area, with the line of the
    entry it names, and the field marked, in both modes."""
    _dialogue(page, server)
    field, error = page.locator("#lexicon"), page.locator("#error")
    _pronunciations(page, "tomato [T][AH0][M][EY1][T][OW2]\nfoo\t[F][XX9]\n")
    for kind in ("Dialogue", "One text"):
        page.get_by_label(kind, exact=True).check()
        with page.expect_response(lambda r: r.request.method == "POST") as resp:
            page.click("#speak")
        assert resp.value.status == 422 and resp.value.json()["error"]["param"] == "lexicon"
        expect(error).to_contain_text("lexicon entry 'foo' (Pronunciations, line 2): unknown token [XX9]")
        assert error.inner_text().startswith("422")
        expect(field).to_have_attribute("aria-invalid", "true")
        expect(page.locator("#dialogue [aria-invalid]")).to_have_count(0)  # no turn is at fault
        field.press("End")
        page.keyboard.type("\n")
        expect(field).not_to_have_attribute("aria-invalid", "true")
    assert [p for p in page.problems if "status of 422" not in p] == []
