// The page served at / by `cosyllama serve`: the server's public API from a browser.
// POST /v1/audio/speech (streamed wav/pcm is played with Web Audio as it arrives),
// POST /dev/captioned_speech (with "Captions": the whole file and its sentences' and words' times),
// POST /v1/audio/dialogue ("Dialogue": turns, each in its voice, played as speech is),
// POST /dev/captioned_dialogue (a dialogue with "Captions": each sentence with its speaker),
// GET/POST/DELETE /v1/voices. No build step, no dependency.
"use strict";

const PCM_RATE = 24000; // pcm responses: 16-bit little-endian mono at 24 kHz
const WAV_HEADER = 44; // the server's wav header (16-bit mono PCM)
const KEY_STORE = "cosyllama.apiKey"; // sessionStorage: this tab only
const MAX_RECORD_S = 30; // the server refuses longer prompt clips
const SPEECH_PATH = "/v1/audio/speech";
const CAPTIONED_PATH = "/dev/captioned_speech"; // one JSON object: audio (base64), segments, srt, vtt
const CAPTIONED_DIALOGUE_PATH = "/dev/captioned_dialogue"; // the same, each segment naming its voice
const DIALOGUE_PATH = "/v1/audio/dialogue";
// a request's lexicon, as the server bounds it: entries, characters of a word, of its tokens
const MAX_LEXICON_ENTRIES = 1000;
const MAX_LEXICON_WORD = 64;
const MAX_LEXICON_TOKENS = 256;
const FIRST_TURNS = ["Good morning! Did you sleep well?", "Not really. The neighbours had a party."];

const $ = (id) => document.getElementById(id);

const state = {
  controller: null, // AbortController of the running speech request
  run: null, // the running request: { body, samples, rate } (what Stop reports)
  ctx: null, // AudioContext, made on the first Speak click (browsers need a gesture)
  sources: [], // scheduled AudioBufferSourceNodes of the current stream
  downloadUrl: null,
  rawUrl: null, // pcm's own bytes, beside its wav download
  playerUrl: null,
  captionUrls: [], // the SRT and VTT downloads
  captions: null, // shown captions: { lines: [{ el, start, end, words: [{ el, start, end }] }], line, word }
  raf: 0, // requestAnimationFrame following the player's time
  recorded: null, // Blob (wav) from the microphone
  recorder: null,
  playing: 0, // sources not yet ended
  voices: null, // the server's voices, as last listed (null: not yet)
  turnIds: 0, // for the ids of the dialogue's fields
};

// -- small helpers ------------------------------------------------------------------------------

function apiKey() {
  return $("api-key").value.trim();
}

function authHeaders(extra = {}) {
  const key = apiKey();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

// Each part of the page reports in its own place: "speak" (the speech's status and error, beside
// its stats), "voices" (under the voice menu: listing and deleting), "add" (the Add a voice section).
const AREAS = {
  speak: ["status", "error"],
  voices: ["voices-status", "voices-error"],
  add: ["add-status", "add-error"],
};

function report(area, text, kind) {
  const el = $(AREAS[area][0]);
  el.textContent = text;
  el.dataset.state = kind;
}

function setStatus(text, kind) {
  report("speak", text, kind);
}

function showError(message, area = "speak") {
  const box = $(AREAS[area][1]);
  box.textContent = message;
  box.hidden = false;
  report(area, area === "speak" ? "Error" : "", "error");
  box.scrollIntoView({ block: "nearest" }); // on a phone it may lie below the button pressed
}

function clearError(area = "speak") {
  const box = $(AREAS[area][1]);
  box.hidden = true;
  box.textContent = "";
}

// A refusal from the server: { status, message (its own words), code }.
async function refusal(resp) {
  let text = "";
  try {
    text = await resp.text();
  } catch (e) {
    text = "";
  }
  const out = { status: resp.status, message: text.trim(), code: null, param: null };
  try {
    const j = JSON.parse(text);
    if (j && j.error && typeof j.error.message === "string") {
      out.message = j.error.message;
      out.code = j.error.code || null;
      out.param = typeof j.error.param === "string" ? j.error.param : null;
    } else if (j && j.detail) {
      out.message = typeof j.detail === "string" ? j.detail : JSON.stringify(j.detail);
    }
  } catch (e) {
    // not JSON: keep the text
  }
  out.text = `${resp.status} ${resp.statusText || ""}`.trim() + (out.message ? `: ${out.message}` : "");
  return out;
}

async function errorText(resp) {
  return (await refusal(resp)).text;
}

// fetch with the API key. A 401 opens the key form at the top of the page and gives null, and
// the area pressed says where the key goes (the voice menu says so itself). Network failures throw.
async function api(path, options, area) {
  const sent = Boolean(apiKey());
  const resp = await fetch(path, { ...options, headers: authHeaders(options.headers || {}) });
  if (resp.status !== 401) {
    return resp;
  }
  askKey(sent);
  report(area, area === "voices" ? "" : "This needs the server's API key: enter it at the top of the page.", "key");
  return null;
}

// -- the API key --------------------------------------------------------------------------------

function askKey(sent) {
  $("key-section").hidden = false;
  $("key-message").textContent = sent
    ? "The server did not accept this API key. Check it and enter it again."
    : "This server needs an API key. Enter it here to use the page.";
  $("key-message").dataset.state = "needed";
  $("api-key").focus();
}

async function useKey(ev) {
  ev.preventDefault();
  const value = apiKey();
  if (value) sessionStorage.setItem(KEY_STORE, value);
  else sessionStorage.removeItem(KEY_STORE);
  $("key-message").textContent = "Checking the key…";
  $("key-message").dataset.state = "busy";
  if (await loadVoices()) {
    $("key-message").textContent = value ? "Key accepted." : "This server needs no key.";
    $("key-message").dataset.state = "ok";
    for (const area of ["speak", "voices", "add"]) {
      if ($(AREAS[area][0]).dataset.state === "key") report(area, "", "idle");
    }
  }
}

function networkError(e) {
  return `Could not reach the server: ${e && e.message ? e.message : e}`;
}

function seconds(x) {
  return `${x.toFixed(2)} s`;
}

// -- voices -------------------------------------------------------------------------------------

// Fill the voice menu from the server (keeping the selection, or selecting `select`); true if it did.
async function loadVoices(select) {
  let resp;
  try {
    resp = await api("/v1/voices", {}, "voices");
  } catch (e) {
    showError(networkError(e), "voices");
    return false;
  }
  const menu = $("voice");
  if (!resp) {
    if (!menu.options.length) {
      const opt = document.createElement("option");
      opt.value = "";
      opt.textContent = "enter the API key above first";
      menu.append(opt);
      turnRows().forEach((row, k) => fillTurnMenu(row, k));
      updateForm();
    }
    return false;
  }
  if (!resp.ok) {
    showError(`Listing the voices failed: ${await errorText(resp)}`, "voices");
    return false;
  }
  clearError("voices");
  const { voices } = await resp.json();
  state.voices = voices;
  fillMenu(menu, voices, select || menu.value);
  turnRows().forEach((row, k) => fillTurnMenu(row, k));
  updateForm();
  return true;
}

// A voice menu (the one text's, or a turn's) with the server's voices, `keep` selected if it is one;
// `short`: their ids only (a turn's narrow menu), the length and transcript as its tooltip.
function fillMenu(menu, voices, keep, short = false) {
  menu.textContent = "";
  for (const v of voices) {
    const opt = document.createElement("option");
    opt.value = v.id;
    const about = `${v.seconds.toFixed(1)} s${v.has_transcript ? ", transcript" : ""}`;
    opt.textContent = short ? v.id : `${v.id} (${about})`;
    if (short) opt.title = about;
    opt.dataset.transcript = v.has_transcript ? "1" : "";
    menu.append(opt);
  }
  if (!voices.length) {
    const opt = document.createElement("option");
    opt.value = "";
    opt.textContent = "no voice yet: add one below";
    menu.append(opt);
  }
  if (voices.some((v) => v.id === keep)) {
    menu.value = keep;
  }
}

async function deleteVoice() {
  const id = $("voice").value;
  if (!id || !window.confirm(`Delete the voice "${id}"?`)) {
    return;
  }
  clearError("voices");
  report("voices", `Deleting the voice ${id}…`, "busy");
  let resp;
  try {
    resp = await api(`/v1/voices/${encodeURIComponent(id)}`, { method: "DELETE" }, "voices");
  } catch (e) {
    showError(networkError(e), "voices");
    return;
  }
  if (!resp) return;
  if (resp.status === 404) {
    report("voices", `The voice ${id} was already gone from the server; the list is refreshed.`, "done");
  } else if (!resp.ok) {
    showError(`Deleting the voice failed: ${await errorText(resp)}`, "voices");
    return;
  } else {
    report("voices", `Voice ${id} deleted`, "done");
  }
  await loadVoices();
}

async function addVoice(ev) {
  ev.preventDefault();
  clearError("add");
  const file = $("voice-file").files[0];
  const clip = file || state.recorded;
  if (!clip) {
    showError("Choose an audio file or record one first.", "add");
    $("voice-file").focus();
    return;
  }
  const form = new FormData();
  form.append("audio", clip, file ? file.name : "microphone.wav");
  const text = $("voice-text").value.trim();
  const id = $("voice-id").value.trim();
  if (text) form.append("text", text);
  if (id) form.append("id", id);
  if ($("voice-replace").checked) form.append("replace", "true");
  $("add-voice").disabled = true;
  report("add", "Adding the voice…", "busy");
  try {
    const resp = await api("/v1/voices", { method: "POST", body: form }, "add");
    if (!resp) return;
    if (!resp.ok) {
      const why = await refusal(resp);
      let text = `Adding the voice failed: ${why.text}`;
      if (why.status === 409 && why.code === "too_many_voices") {
        text = "This server holds as many voices as it may: delete one first (Delete, beside the voice menu), " +
          "or give the id of an existing voice and tick \"Replace a voice of this id\".";
      } else if (why.status === 409 && id) {
        text = `A voice ${id} exists already: tick "Replace a voice of this id" to replace it, or choose another id.`;
      }
      showError(text, "add");
      return;
    }
    const added = (await resp.json()).id;
    clearVoiceForm(); // a second click would send the same clip and id again
    report("add", `Voice ${added} added`, "done");
    await loadVoices(added);
  } catch (e) {
    showError(networkError(e), "add");
  } finally {
    $("add-voice").disabled = false;
  }
}

function clearVoiceForm() {
  $("voice-form").reset(); // the file, transcript, id and the replace box
  state.recorded = null;
  const preview = $("record-preview");
  if (preview.src) URL.revokeObjectURL(preview.src);
  preview.removeAttribute("src");
  preview.hidden = true;
  $("record-status").textContent = "";
  delete $("record-status").dataset.state;
}

// -- microphone: MediaRecorder, then decoded and sent as 16-bit wav (the server reads wav, not webm)

async function toggleRecording() {
  if (state.recorder) {
    state.recorder.stop();
    return;
  }
  clearError("add");
  if (!window.isSecureContext || !navigator.mediaDevices || !window.MediaRecorder) {
    showError("The microphone needs a secure page: open this page over https or on localhost / 127.0.0.1.", "add");
    return;
  }
  let stream;
  try {
    stream = await navigator.mediaDevices.getUserMedia({ audio: true });
  } catch (e) {
    showError(`No microphone: ${e.message || e}`, "add");
    return;
  }
  const chunks = [];
  const rec = new MediaRecorder(stream);
  const started = performance.now();
  const tick = window.setInterval(() => {
    const s = (performance.now() - started) / 1000;
    $("record-status").textContent = `Recording… ${s.toFixed(1)} s`;
    $("record-status").dataset.seconds = s.toFixed(1);
    if (s >= MAX_RECORD_S) rec.stop();
  }, 100);
  rec.ondataavailable = (e) => {
    if (e.data.size) chunks.push(e.data);
  };
  rec.onstop = async () => {
    window.clearInterval(tick);
    stream.getTracks().forEach((t) => t.stop());
    state.recorder = null;
    $("record").setAttribute("aria-pressed", "false");
    $("record").textContent = "Record from the microphone";
    try {
      const blob = new Blob(chunks, { type: rec.mimeType });
      const decoded = await new OfflineAudioContext(1, 1, 48000).decodeAudioData(await blob.arrayBuffer());
      state.recorded = new Blob([encodeWav(mono(decoded), decoded.sampleRate)], { type: "audio/wav" });
      $("voice-file").value = "";
      const preview = $("record-preview");
      if (preview.src) URL.revokeObjectURL(preview.src);
      preview.src = URL.createObjectURL(state.recorded);
      preview.hidden = false;
      $("record-status").textContent = `Recorded ${decoded.duration.toFixed(1)} s; it is sent when you add the voice`;
      $("record-status").dataset.state = "recorded";
    } catch (e) {
      showError(`The recording could not be decoded: ${e.message || e}`, "add");
    }
  };
  state.recorder = rec;
  rec.start(250);
  $("record").setAttribute("aria-pressed", "true");
  $("record").textContent = "Stop recording";
  $("record-status").dataset.state = "recording";
}

function mono(buffer) {
  const out = new Float32Array(buffer.length);
  for (let c = 0; c < buffer.numberOfChannels; c++) {
    const ch = buffer.getChannelData(c);
    for (let i = 0; i < ch.length; i++) out[i] += ch[i] / buffer.numberOfChannels;
  }
  return out;
}

function wavHeader(rate, dataBytes) {
  const h = new DataView(new ArrayBuffer(WAV_HEADER));
  const text = (at, s) => [...s].forEach((c, i) => h.setUint8(at + i, c.charCodeAt(0)));
  text(0, "RIFF");
  h.setUint32(4, 36 + dataBytes, true);
  text(8, "WAVE");
  text(12, "fmt ");
  h.setUint32(16, 16, true);
  h.setUint16(20, 1, true); // PCM
  h.setUint16(22, 1, true); // mono
  h.setUint32(24, rate, true);
  h.setUint32(28, rate * 2, true);
  h.setUint16(32, 2, true);
  h.setUint16(34, 16, true);
  text(36, "data");
  h.setUint32(40, dataBytes, true);
  return new Uint8Array(h.buffer);
}

function encodeWav(samples, rate) {
  const pcm = new DataView(new ArrayBuffer(samples.length * 2));
  for (let i = 0; i < samples.length; i++) {
    const x = Math.max(-1, Math.min(1, samples[i]));
    pcm.setInt16(2 * i, Math.round(x * 32767), true);
  }
  return new Blob([wavHeader(rate, pcm.byteLength), pcm.buffer]);
}

// -- dialogue: a list of turns, each a voice menu and a text ------------------------------------

function dialogueMode() {
  return document.querySelector('input[name="kind"]:checked').value === "dialogue";
}

function turnRows() {
  return [...$("turns").children];
}

// A turn's menu: the voice picked for it (by hand, or copied from the turn two before), else the
// voices in turn (1st, 2nd, 1st ... for two), so that a new dialogue alternates its speakers.
function fillTurnMenu(row, k) {
  const menu = row.querySelector("select");
  if (!state.voices) { // not listed yet: what the one text's menu says
    const opt = document.createElement("option");
    opt.value = "";
    opt.textContent = $("voice").options.length ? $("voice").options[0].textContent : "…";
    menu.replaceChildren(opt);
    return;
  }
  const voices = state.voices;
  const auto = voices.length ? voices[k % voices.length].id : "";
  fillMenu(menu, voices, menu.dataset.picked ? menu.dataset.picked : auto, true);
}

function addTurn(text = "", focus = true) {
  const rows = turnRows();
  const k = rows.length;
  const id = ++state.turnIds;
  const row = document.createElement("li");
  row.className = "turn";
  row.innerHTML = `<span class="turn-n" aria-hidden="true"></span>
    <label class="sr-only" for="turn-voice-${id}"></label>
    <select id="turn-voice-${id}" class="turn-voice"></select>
    <label class="sr-only" for="turn-text-${id}"></label>
    <textarea id="turn-text-${id}" class="turn-text" rows="2"></textarea>
    <button type="button" class="remove-turn">Remove</button>`;
  const menu = row.querySelector("select");
  const area = row.querySelector("textarea");
  area.value = text;
  if (k >= 2 && rows[k - 2].querySelector("select").value) {
    menu.dataset.picked = rows[k - 2].querySelector("select").value; // A, B, A, B ...
  }
  menu.addEventListener("change", () => {
    menu.dataset.picked = menu.value;
    valid(menu);
  });
  area.addEventListener("input", () => valid(area));
  row.querySelector(".remove-turn").addEventListener("click", () => removeTurn(row));
  $("turns").append(row);
  fillTurnMenu(row, k);
  numberTurns();
  if (focus) area.focus();
}

function removeTurn(row) {
  const rows = turnRows();
  if (rows.length < 2) return; // a dialogue has a turn at least
  const k = rows.indexOf(row);
  row.remove();
  numberTurns();
  // the focus stays in the list: the turn now in its place, else the one before
  const left = turnRows();
  const next = left[Math.min(k, left.length - 1)];
  const remove = next.querySelector(".remove-turn");
  (remove.disabled ? next.querySelector("textarea") : remove).focus();
}

// The turns' numbers, in their labels too ("Turn 2 voice"), after an add or a remove.
function numberTurns() {
  const rows = turnRows();
  rows.forEach((row, k) => {
    const n = k + 1;
    row.querySelector(".turn-n").textContent = `${n}`;
    const [voiceLabel, textLabel] = row.querySelectorAll("label");
    voiceLabel.textContent = `Turn ${n} voice`;
    textLabel.textContent = `Turn ${n} text`;
    row.querySelector("textarea").placeholder = `What turn ${n} says`;
    const remove = row.querySelector(".remove-turn");
    remove.setAttribute("aria-label", `Remove turn ${n}`);
    remove.disabled = rows.length < 2;
  });
}

// A field the server named (`turns[1].voice`, pydantic's `turns.1.text`, `pause_between_turns`):
// marked invalid (aria-invalid, described by the error) until it is changed. The field, or null.
function fieldOf(param) {
  if (!param) return null;
  if (param === "pause_between_turns") return $("pause");
  if (param === "lexicon" || param.startsWith("lexicon.")) return $("lexicon");
  const m = /^(?:turns|inputs)(?:\[(\d+)\]|\.(\d+))\.(voice|voice_id|text)$/.exec(param);
  const row = m && turnRows()[Number(m[1] || m[2])];
  return row ? row.querySelector(m[3] === "text" ? "textarea" : "select") : null;
}

function invalid(el) {
  if (el.getAttribute("aria-invalid") === "true") return;
  const own = el.getAttribute("aria-describedby");
  el.dataset.describedby = own || "";
  el.setAttribute("aria-invalid", "true");
  el.setAttribute("aria-describedby", own ? `error ${own}` : "error");
}

function valid(el) {
  if (el.getAttribute("aria-invalid") !== "true") return;
  el.removeAttribute("aria-invalid");
  if (el.dataset.describedby) el.setAttribute("aria-describedby", el.dataset.describedby);
  else el.removeAttribute("aria-describedby");
  delete el.dataset.describedby;
}

function clearInvalid() {
  for (const el of $("speak-form").querySelectorAll('[aria-invalid="true"]')) valid(el);
}

// The server's words with its turns counted as the page counts them ("turns[1] (bob): ..." is "Turn 2 (bob): ..."),
// and a voice added on this page, not with the API's POST.
function pageWords(message) {
  return message.replace(/\b(?:turns|inputs)(?:\[(\d+)\]|\.(\d+))/g, (_, a, b) => `Turn ${Number(a || b) + 1}`)
    .replace(/add one with POST \/v1\/voices/, "add one below");
}

// -- pronunciations: the lexicon sent with every request ----------------------------------------

// The Pronunciations field as a lexicon file reads (docs/pronunciation.md): `word<TAB>tokens` or
// `word tokens` (a TAB lets the word hold spaces), `#` comments and blank lines skipped, text after
// a `#` in the tokens a comment. { entries: {word: tokens} or null when there is none, lines: word ->
// its line }, or { error } naming the first line the page cannot read (the server checks the tokens).
function readLexicon() {
  const entries = {};
  const lines = new Map(); // the word -> its line number
  const seen = new Map(); // the word as the server compares words (Latin ignoring case) -> its line number
  const rows = $("lexicon").value.split(/\r?\n/);
  for (let i = 0; i < rows.length; i++) {
    const raw = rows[i];
    if (!raw.trim() || raw.trimStart().startsWith("#")) continue;
    let word;
    let spec;
    const tab = raw.indexOf("\t");
    if (tab >= 0) {
      word = raw.slice(0, tab);
      spec = raw.slice(tab + 1);
    } else {
      [, word, spec] = /^(\S+)\s*(.*)$/.exec(raw.trim());
    }
    if (spec.includes("#")) spec = spec.slice(0, spec.indexOf("#"));
    word = word.trim().split(/\s+/).join(" ").normalize("NFC");
    spec = spec.trim();
    const fail = (why) => ({ error: `Pronunciations, line ${i + 1}${word ? ` (${JSON.stringify(word)})` : ""}: ${why}` });
    if (!word) return fail("no word before its tokens.");
    if (!spec) {
      return fail("no tokens. Write the word, spaces or a TAB, then its tokens in brackets, " +
        "e.g. tomato [T][AH0][M][EY1][T][OW2].");
    }
    const loose = spec.replace(/\[[^[\]]*\]/g, " ").trim();
    if (loose) {
      const shown = loose.length > 40 ? `${loose.slice(0, 40)}…` : loose;
      return fail(`${JSON.stringify(shown)} is not in brackets. Write each token in brackets, e.g. [T][AH0][M].`);
    }
    if (word.length > MAX_LEXICON_WORD) return fail(`a word has at most ${MAX_LEXICON_WORD} characters.`);
    if (spec.length > MAX_LEXICON_TOKENS) {
      return fail(`${spec.length} characters of tokens; at most ${MAX_LEXICON_TOKENS}.`);
    }
    const key = word.toLowerCase(); // no case in CJK: the same as its exact characters
    if (seen.has(key)) return fail(`the word is on line ${seen.get(key)} already.`);
    if (seen.size === MAX_LEXICON_ENTRIES) return fail(`more than ${MAX_LEXICON_ENTRIES} entries; the server takes at most ${MAX_LEXICON_ENTRIES}.`);
    seen.set(key, i + 1);
    lines.set(word, i + 1);
    entries[word] = spec;
  }
  return { entries: lines.size ? entries : null, lines };
}

// The server's refusal of the lexicon with the line of the entry it names: "lexicon entry 'foo'
// (Pronunciations, line 2): unknown token ...".
function lexiconWords(message, lines) {
  for (const [word, n] of lines) {
    for (const q of [`'${word}'`, `"${word}"`]) { // as Python's repr quotes it
      const at = message.indexOf(`entry ${q}`);
      if (at >= 0) {
        const end = at + `entry ${q}`.length;
        return `${message.slice(0, end)} (Pronunciations, line ${n})${message.slice(end)}`;
      }
    }
  }
  return message;
}

// The summary says how many entries the field holds, so that a closed one still shows they are sent.
function countLexicon() {
  const n = $("lexicon").value.split(/\r?\n/).filter((l) => l.trim() && !l.trimStart().startsWith("#")).length;
  $("lexicon-count").textContent = n ? `(${n} entr${n === 1 ? "y" : "ies"})` : "";
}

// -- speech -------------------------------------------------------------------------------------

// The options both kinds share: format, greedy, speed, seed.
function options(body) {
  body.response_format = $("format").value;
  body.greedy = $("greedy").checked;
  const speed = Number($("speed").value || "1");
  if (speed !== 1) body.speed = speed;
  const seedText = $("seed").value.trim();
  body.seed = seedText === "" ? Math.floor(Math.random() * 2 ** 31) : Number(seedText);
  return body;
}

function dialogueBody(captioned) {
  const pause = $("pause").value.trim();
  const body = options({
    turns: turnRows().map((row) => ({
      voice: row.querySelector("select").value,
      text: row.querySelector("textarea").value,
    })),
    pause_between_turns: pause === "" ? 0 : Number(pause),
  });
  if (captioned) {
    body.stream = false; // the whole file in one answer, with every segment's times and speaker
    body.return_timestamps = true;
  } else if (streams(body)) {
    body.stream_format = "audio";
  }
  return body;
}

function requestBody(captioned) {
  const body = options({ input: $("text").value, voice: $("voice").value });
  const mode = document.querySelector('input[name="mode"]:checked').value;
  if (mode) body.mode = mode;
  if (mode === "instruct") body.instructions = $("instructions").value;
  if (captioned) {
    body.stream = false; // the whole file in one answer, with every segment's times
    body.return_timestamps = true;
  } else if (streams(body)) {
    body.stream_format = "audio";
  }
  return body;
}

// Streamed playback takes wav or pcm at speed 1 (the server streams mp3 and opus too, but a
// browser plays those only as a whole file here; speed applies to the finished audio).
function streams(body) {
  return $("stream").checked && (body.response_format === "wav" || body.response_format === "pcm") &&
    (body.speed === undefined || body.speed === 1);
}

function audioContext() {
  if (!state.ctx) {
    state.ctx = new AudioContext();
  }
  state.ctx.resume();
  return state.ctx;
}

// Speak while no request runs; Stop while a request runs or audio plays.
function refreshButtons() {
  $("speak").disabled = Boolean(state.controller);
  $("stop").disabled = !state.controller && state.playing === 0 && $("player").paused;
}

async function speak(ev) {
  ev.preventDefault();
  if (state.controller) state.controller.abort(); // Ctrl+Enter while a request runs: the new one wins
  state.controller = null;
  stopPlayback();
  clearError();
  clearInvalid();
  const dialogue = dialogueMode();
  const captioned = $("captions").checked;
  const lexicon = readLexicon();
  if (lexicon.error) {
    $("lexicon-box").open = true;
    showError(lexicon.error);
    invalid($("lexicon"));
    $("lexicon").focus();
    return;
  }
  const body = dialogue ? dialogueBody(captioned) : requestBody(captioned);
  if (lexicon.entries) body.lexicon = lexicon.entries; // none: no field, the request as before
  const unvoiced = dialogue ? body.turns.findIndex((t) => !t.voice) : body.voice ? -1 : 0;
  if (unvoiced >= 0) {
    showError(dialogue ? `Turn ${unvoiced + 1} has no voice: add one below.`
      : "Pick a voice first, or add one below.");
    if (dialogue) invalid(turnRows()[unvoiced].querySelector("select"));
    return;
  }
  const ctx = audioContext(); // inside the click: allowed to start
  const controller = new AbortController();
  state.controller = controller;
  state.run = { body, samples: 0, rate: PCM_RATE };
  refreshButtons();
  resetResult();
  setStatus("Synthesizing…", "busy");
  const t0 = performance.now();
  try {
    const path = dialogue ? (captioned ? CAPTIONED_DIALOGUE_PATH : DIALOGUE_PATH)
      : captioned ? CAPTIONED_PATH : SPEECH_PATH;
    const resp = await api(path, {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: controller.signal,
    }, "speak");
    if (!resp) return;
    if (!resp.ok && (dialogue || resp.status === 422)) {
      // the server names the turn (and its field) or the lexicon: said as the page counts turns and
      // lines, the field marked
      const why = await refusal(resp);
      const field = fieldOf(why.param);
      if (field === $("lexicon")) {
        $("lexicon-box").open = true;
        showError(lexiconWords(why.text, lexicon.lines));
      } else {
        showError(dialogue ? pageWords(why.text) : why.text);
      }
      if (field) invalid(field);
      return;
    }
    if (resp.status === 404) {
      // the voice was deleted since the menu was filled (another tab, another client)
      showError(`The voice ${body.voice} is no longer on the server (it was deleted elsewhere). ` +
        "The voice menu is refreshed: pick a voice and press Speak again.");
      await loadVoices();
      return;
    }
    if (!resp.ok) {
      showError(await errorText(resp));
      return;
    }
    if (captioned) {
      await playCaptioned(resp, body, ctx, t0);
    } else if (body.stream_format) {
      await playStream(resp, body, ctx, t0);
    } else {
      await playWhole(await resp.arrayBuffer(), resp.headers.get("content-type"), body, ctx, t0);
    }
  } catch (e) {
    if (!controller.signal.aborted) {
      showError(networkError(e));
    } // else Stop said so, or a newer request runs
  } finally {
    if (state.controller === controller) {
      state.controller = null;
      state.run = null;
      refreshButtons();
    }
  }
}

function concat(a, b) {
  if (!a.length) return b;
  const out = new Uint8Array(a.length + b.length);
  out.set(a);
  out.set(b, a.length);
  return out;
}

async function playStream(resp, body, ctx, t0) {
  const reader = resp.body.getReader();
  const parts = [];
  let pending = new Uint8Array(0); // bytes not yet played (header, an odd byte)
  let header = body.response_format === "wav" ? WAV_HEADER : 0;
  let rate = PCM_RATE;
  let samples = 0;
  let first = null;
  let at = 0;
  const run = state.run;
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    parts.push(value);
    pending = concat(pending, value);
    if (header) {
      if (pending.length < header) continue;
      rate = new DataView(pending.buffer, pending.byteOffset, header).getUint32(24, true);
      pending = pending.slice(header);
      header = 0;
      run.rate = rate;
    }
    const n = pending.length >> 1;
    if (!n) continue;
    const pcm = new DataView(pending.buffer, pending.byteOffset, 2 * n);
    const f32 = new Float32Array(n);
    for (let i = 0; i < n; i++) f32[i] = pcm.getInt16(2 * i, true) / 32768;
    pending = pending.slice(2 * n);
    if (first === null) {
      first = (performance.now() - t0) / 1000;
      stat("stat-first", seconds(first));
      stat("stat-seed", String(body.seed));
    }
    const buf = ctx.createBuffer(1, n, rate);
    buf.copyToChannel(f32, 0);
    const src = ctx.createBufferSource();
    src.buffer = buf;
    src.connect(ctx.destination);
    at = Math.max(at, ctx.currentTime + 0.05);
    src.start(at);
    at += buf.duration;
    track(src);
    samples += n;
    run.samples = samples;
    setStatus(`Playing… ${seconds(samples / rate)} received`, "playing");
  }
  const wall = (performance.now() - t0) / 1000;
  // the samples as a wav with the real sizes (a streamed wav header says "length unknown"):
  // for the player, and the download of wav and of pcm (which few players open raw)
  const skip = body.response_format === "wav" ? WAV_HEADER : 0;
  const data = new Blob(parts).slice(skip, skip + 2 * samples);
  const wav = new Blob([wavHeader(rate, 2 * samples), data], { type: "audio/wav" });
  finishResult(body, samples / rate, first, wall, wav, body.response_format === "pcm" ? data : null);
  showPlayer(wav);
}

// A whole file (`data`, an ArrayBuffer of media type `type`): stats, download, and the player.
async function playWhole(data, type, body, ctx, t0) {
  const wall = (performance.now() - t0) / 1000;
  const fmt = body.response_format;
  let length = null;
  if (fmt === "pcm") {
    length = data.byteLength / 2 / PCM_RATE;
  } else {
    try {
      length = (await ctx.decodeAudioData(data.slice(0))).duration;
    } catch (e) {
      length = null; // the browser cannot decode it; the download still works
    }
  }
  const file = new Blob([data], { type: type || "application/octet-stream" });
  if (fmt === "pcm") {
    const wav = new Blob([wavHeader(PCM_RATE, data.byteLength), data], { type: "audio/wav" });
    finishResult(body, length, wall, wall, wav, file);
    showPlayer(wav);
  } else {
    finishResult(body, length, wall, wall, file, null);
    showPlayer(file);
  }
  try {
    await $("player").play();
  } catch (e) {
    setStatus("Done: press play", "done");
  }
}

// -- captions: /dev/captioned_speech's answer, shown under the player and followed as it plays ----

async function playCaptioned(resp, body, ctx, t0) {
  const answer = await resp.json();
  const text = atob(answer.audio);
  const bytes = new Uint8Array(text.length);
  for (let i = 0; i < text.length; i++) bytes[i] = text.charCodeAt(i);
  showCaptions(answer, fileName(body));
  await playWhole(bytes.buffer, answer.audio_format, body, ctx, t0);
}

function clock(x) {
  const m = Math.floor(x / 60);
  return `${m}:${(x - 60 * m).toFixed(1).padStart(4, "0")}`;
}

// One line per segment (a button: it seeks there), its words as spans where their times are known.
function showCaptions(answer, name) {
  const list = $("caption-lines");
  list.textContent = "";
  const lines = [];
  const missing = []; // [line number, why] of the segments without word times
  answer.segments.forEach((seg, i) => {
    const li = document.createElement("li");
    const button = document.createElement("button");
    button.type = "button";
    button.className = "caption-line";
    const time = document.createElement("span");
    time.className = "caption-time";
    time.textContent = clock(seg.start);
    button.append(time, " ");
    if (seg.voice) { // a dialogue's: who speaks it
      const who = document.createElement("span");
      who.className = "caption-voice";
      who.textContent = seg.voice;
      button.append(who, " ");
    }
    const line = { el: button, start: seg.start, end: seg.end, words: [] };
    if (seg.words && seg.words.length) {
      line.words = wordSpans(button, seg.text, seg.words);
    } else {
      button.append(seg.text);
      if (!seg.words) missing.push([i + 1, seg.words_why || "the server made none"]);
    }
    button.addEventListener("click", () => seek(line.start));
    li.append(button);
    list.append(li);
    lines.push(line);
  });
  state.captions = { lines, line: null, word: null };
  const note = $("caption-note");
  const why = [...new Set(missing.map(([, w]) => w))].join("; ");
  note.textContent = !missing.length ? ""
    : missing.length === lines.length ? `No word times: ${why}`
      : `No word times for sentence${missing.length > 1 ? "s" : ""} ${missing.map(([n]) => n).join(", ")}: ${why}`;
  note.hidden = !missing.length;
  const files = [["caption-srt", answer.srt, "application/x-subrip", "srt"],
    ["caption-vtt", answer.vtt, "text/vtt", "vtt"]];
  for (const [id, data, type, ext] of files) {
    const url = URL.createObjectURL(new Blob([data], { type }));
    state.captionUrls.push(url);
    $(id).href = url;
    $(id).download = `${name}.${ext}`; // beside the audio's download, of the same name
  }
  $("caption-area").hidden = false;
}

// The segment's text into `button`, each aligned word a span (the words are the text's own
// whitespace-separated tokens, in order; a token of punctuation only has no time and stays text).
function wordSpans(button, text, words) {
  const out = [];
  const span = (w) => {
    const el = document.createElement("span");
    el.className = "caption-word";
    el.textContent = w.word;
    out.push({ el, start: w.start, end: w.end });
    return el;
  };
  let k = 0;
  const nodes = text.split(/(\s+)/)
    .map((part) => (k < words.length && part === words[k].word ? span(words[k++]) : part));
  if (k < words.length) { // not the text's own tokens: the words alone
    out.length = 0;
    words.forEach((w, j) => {
      if (j) button.append(" ");
      button.append(span(w));
    });
  } else {
    button.append(...nodes);
  }
  return out;
}

function seek(t) {
  const player = $("player");
  player.currentTime = t;
  highlight();
  player.play().catch(() => {}); // a click: allowed to play
}

// Mark the sentence and the word at the player's time: a word stays marked until the next one starts.
function highlight() {
  const cap = state.captions;
  if (!cap) return;
  const t = $("player").currentTime;
  const line = cap.lines.find((l) => t >= l.start && t < l.end) || null;
  let word = null;
  if (line) {
    for (let j = 0; j < line.words.length && line.words[j].start <= t; j++) word = line.words[j];
  }
  mark(cap, "line", line);
  mark(cap, "word", word);
}

function mark(cap, kind, item) {
  const old = cap[kind];
  if (old === item) return;
  if (old) {
    old.el.classList.remove("current");
    old.el.removeAttribute("aria-current");
  }
  if (item) {
    item.el.classList.add("current");
    item.el.setAttribute("aria-current", "true");
    if (kind === "line") keepInView(item.el);
  }
  cap[kind] = item;
}

// Scroll the captions' own box (not the page) to show the current sentence.
function keepInView(el) {
  const box = $("caption-lines");
  const top = el.offsetTop - box.offsetTop;
  if (top < box.scrollTop || top + el.offsetHeight > box.scrollTop + box.clientHeight) {
    box.scrollTop = top;
  }
}

function follow() {
  highlight();
  state.raf = $("player").paused ? 0 : requestAnimationFrame(follow);
}

function clearCaptions() {
  if (state.raf) cancelAnimationFrame(state.raf);
  state.raf = 0;
  state.captions = null;
  $("caption-area").hidden = true;
  $("caption-lines").textContent = "";
  $("caption-note").textContent = "";
  for (const url of state.captionUrls) URL.revokeObjectURL(url);
  state.captionUrls = [];
  for (const id of ["caption-srt", "caption-vtt"]) $(id).removeAttribute("href");
}

// The finished audio in the player, to replay (a stream has played through Web Audio already).
function showPlayer(blob) {
  const player = $("player");
  state.playerUrl = URL.createObjectURL(blob);
  player.src = state.playerUrl;
  player.hidden = false;
}

function track(src) {
  state.sources.push(src);
  state.playing += 1;
  src.onended = () => {
    state.playing -= 1;
    if (state.playing === 0 && !state.controller) {
      setStatus("Done", "done");
    }
    refreshButtons();
  };
}

const STATS = ["stat-first", "stat-length", "stat-rtf", "stat-seed"];

// One of the stats: shown with its value, hidden without one (no label stands empty).
function stat(id, text) {
  $(id).textContent = text;
  $(id).parentElement.hidden = !text;
  $("stats").hidden = STATS.every((s) => !$(s).textContent);
}

function resetResult() {
  for (const id of STATS) stat(id, "");
  for (const id of ["download", "download-raw"]) {
    $(id).hidden = true;
    $(id).removeAttribute("href");
  }
  $("player").hidden = true;
  $("player").removeAttribute("src");
  for (const url of [state.downloadUrl, state.rawUrl, state.playerUrl]) {
    if (url) URL.revokeObjectURL(url);
  }
  state.downloadUrl = state.rawUrl = state.playerUrl = null;
  clearCaptions();
}

// The downloads' name, without its extension: speech-VOICE-SEED, or dialogue-SEED.
function fileName(body) {
  return body.turns ? `dialogue-${body.seed}` : `speech-${body.voice}-${body.seed}`;
}

// `file`: the download (a wav for pcm); `raw`: pcm's own bytes, offered beside it.
function finishResult(body, length, first, wall, file, raw) {
  stat("stat-first", first === null ? "none" : seconds(first));
  stat("stat-length", length === null ? "?" : seconds(length));
  stat("stat-rtf", length ? (wall / length).toFixed(2) : "?");
  stat("stat-seed", String(body.seed));
  const name = fileName(body);
  const ext = body.response_format === "pcm" ? "wav" : body.response_format;
  state.downloadUrl = URL.createObjectURL(file);
  const a = $("download");
  a.href = state.downloadUrl;
  a.download = `${name}.${ext}`;
  a.textContent = `Download ${ext}`;
  a.hidden = false;
  if (raw) {
    state.rawUrl = URL.createObjectURL(raw);
    const r = $("download-raw");
    r.href = state.rawUrl;
    r.download = `${name}.pcm`;
    r.hidden = false;
  }
  if (state.playing === 0) {
    setStatus(length === 0 ? "Done (no audio)" : "Done", "done");
  }
}

// Silence the streamed audio scheduled in Web Audio.
function stopSources() {
  for (const src of state.sources) {
    src.onended = null;
    try {
      src.stop();
    } catch (e) {
      // not started yet
    }
  }
  state.sources = [];
  state.playing = 0;
}

function stopPlayback() {
  stopSources();
  $("player").pause();
  refreshButtons();
}

function stop() {
  const controller = state.controller;
  const run = state.run;
  stopPlayback();
  if (!controller) {
    setStatus("Stopped", "stopped"); // the audio had all arrived: its stats stand
    return;
  }
  controller.abort(); // the server sees the client go and frees the request's sequence
  // cut short: no length, RTF or download; what had arrived is said once, in the status
  stat("stat-length", "");
  stat("stat-rtf", "");
  setStatus(run && run.samples
    ? `Stopped after ${seconds(run.samples / run.rate)} of audio`
    : "Stopped before any audio arrived", "stopped");
}

// -- form state ---------------------------------------------------------------------------------

function updateForm() {
  const opt = $("voice").selectedOptions[0];
  const hasVoice = Boolean(opt && opt.value);
  const transcript = Boolean(opt && opt.dataset.transcript);
  $("delete-voice").disabled = !hasVoice;
  $("voice-info").textContent = hasVoice
    ? transcript ? "Registered with its transcript: auto mode is zero-shot."
      : "Registered without a transcript: auto mode is cross-lingual; zero-shot needs a transcript."
    : "";
  const zero = document.querySelector('input[name="mode"][value="zero-shot"]');
  zero.disabled = hasVoice && !transcript;
  if (zero.disabled && zero.checked) {
    document.querySelector('input[name="mode"][value=""]').checked = true;
  }
  const mode = document.querySelector('input[name="mode"]:checked').value;
  $("instructions").disabled = mode !== "instruct";
  const fmt = $("format").value;
  const speed = Number($("speed").value || "1");
  const dialogue = dialogueMode();
  $("single-fields").hidden = dialogue;
  $("mode-fields").hidden = dialogue; // each turn in its voice's auto mode
  $("dialogue").hidden = !dialogue;
  const captioned = $("captions").checked;
  $("stream").disabled = captioned; // captions: the whole file, not streamed
  const streamed = $("stream").checked && !captioned;
  let hint = "";
  if (streamed && !(fmt === "wav" || fmt === "pcm")) {
    hint = `${fmt} is fetched whole and played when done; streamed playback takes wav or pcm.`;
  } else if (streamed && speed !== 1) {
    hint = "A speed other than 1 applies to the finished audio: this request is not streamed.";
  }
  $("stream-hint").textContent = hint;
  $("stream-hint").hidden = !hint;
}

function init() {
  const key = sessionStorage.getItem(KEY_STORE);
  if (key) {
    $("api-key").value = key;
    $("key-section").hidden = false; // to change or forget it
  }
  $("key-form").addEventListener("submit", useKey);
  $("speak-form").addEventListener("submit", speak);
  $("stop").addEventListener("click", stop);
  $("voice-form").addEventListener("submit", addVoice);
  $("record").addEventListener("click", toggleRecording);
  $("refresh-voices").addEventListener("click", () => loadVoices());
  $("delete-voice").addEventListener("click", deleteVoice);
  $("voice-file").addEventListener("change", () => {
    if ($("voice-file").files.length) {
      state.recorded = null;
      $("record-preview").hidden = true;
      $("record-status").textContent = "";
      delete $("record-status").dataset.state;
    }
  });
  const choices = 'input[name="kind"], input[name="mode"], #voice, #format, #speed, #stream, #captions';
  for (const el of document.querySelectorAll(choices)) {
    el.addEventListener("change", updateForm);
  }
  $("player").addEventListener("play", () => {
    stopSources(); // replaying a stream that still sounds through Web Audio: one voice at a time
    if (state.captions && !state.raf) state.raf = requestAnimationFrame(follow);
  });
  for (const ev of ["timeupdate", "seeked"]) $("player").addEventListener(ev, highlight);
  $("player").addEventListener("playing", () => {
    setStatus("Playing…", "playing");
    refreshButtons();
  });
  $("player").addEventListener("ended", () => {
    setStatus("Done", "done");
    refreshButtons();
  });
  $("player").addEventListener("pause", refreshButtons);
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && !$("stop").disabled) stop();
  });
  const submitKey = (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) $("speak-form").requestSubmit();
  };
  $("text").addEventListener("keydown", submitKey);
  $("turns").addEventListener("keydown", submitKey);
  $("add-turn").addEventListener("click", () => addTurn());
  $("pause").addEventListener("input", () => valid($("pause")));
  $("lexicon").addEventListener("input", () => {
    valid($("lexicon"));
    countLexicon();
  });
  $("lexicon").addEventListener("keydown", submitKey);
  for (const text of FIRST_TURNS) addTurn(text, false);
  updateForm();
  loadVoices();
}

// read by the browser tests: the Web Audio graph's state
window.cosyllamaPage = {
  get audioState() {
    return state.ctx ? state.ctx.state : "none";
  },
  get scheduled() {
    return state.sources.length;
  },
};

init();
