// The page served at / by `cosyllama serve`: the server's public API from a browser.
// POST /v1/audio/speech (streamed wav/pcm is played with Web Audio as it arrives),
// GET/POST/DELETE /v1/voices. No build step, no dependency.
"use strict";

const PCM_RATE = 24000; // pcm responses: 16-bit little-endian mono at 24 kHz
const WAV_HEADER = 44; // the server's wav header (16-bit mono PCM)
const KEY_STORE = "cosyllama.apiKey"; // sessionStorage: this tab only
const MAX_RECORD_S = 30; // the server refuses longer prompt clips

const $ = (id) => document.getElementById(id);

const state = {
  controller: null, // AbortController of the running speech request
  ctx: null, // AudioContext, made on the first Speak click (browsers need a gesture)
  sources: [], // scheduled AudioBufferSourceNodes of the current stream
  downloadUrl: null,
  playerUrl: null,
  recorded: null, // Blob (wav) from the microphone
  recorder: null,
  playing: 0, // sources not yet ended
};

// -- small helpers ------------------------------------------------------------------------------

function authHeaders(extra = {}) {
  const key = $("api-key").value.trim();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

function setStatus(text, kind) {
  $("status").textContent = text;
  $("status").dataset.state = kind;
}

function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = false;
  setStatus("Error", "error");
}

function clearError() {
  $("error").hidden = true;
  $("error").textContent = "";
}

// The server's own words: its JSON error message, else the text it sent.
async function errorText(resp) {
  let text = "";
  try {
    text = await resp.text();
  } catch (e) {
    text = "";
  }
  let message = text.trim();
  try {
    const j = JSON.parse(text);
    if (j && j.error && typeof j.error.message === "string") {
      message = j.error.message;
    } else if (j && j.detail) {
      message = typeof j.detail === "string" ? j.detail : JSON.stringify(j.detail);
    }
  } catch (e) {
    // not JSON: keep the text
  }
  let out = `${resp.status} ${resp.statusText || ""}`.trim() + (message ? `: ${message}` : "");
  if (resp.status === 401) {
    out += "\n(Enter the server's API key in the Server section.)";
  }
  return out;
}

function networkError(e) {
  return `Could not reach the server: ${e && e.message ? e.message : e}`;
}

function seconds(x) {
  return `${x.toFixed(2)} s`;
}

// -- voices -------------------------------------------------------------------------------------

async function loadVoices(select) {
  let resp;
  try {
    resp = await fetch("/v1/voices", { headers: authHeaders() });
  } catch (e) {
    showError(networkError(e));
    return;
  }
  if (!resp.ok) {
    showError(`Listing the voices failed: ${await errorText(resp)}`);
    return;
  }
  const { voices } = await resp.json();
  const menu = $("voice");
  const keep = select || menu.value;
  menu.textContent = "";
  for (const v of voices) {
    const opt = document.createElement("option");
    opt.value = v.id;
    opt.textContent = `${v.id} (${v.seconds.toFixed(1)} s${v.has_transcript ? ", transcript" : ""})`;
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
  updateForm();
}

async function deleteVoice() {
  const id = $("voice").value;
  if (!id || !window.confirm(`Delete the voice "${id}"?`)) {
    return;
  }
  clearError();
  let resp;
  try {
    resp = await fetch(`/v1/voices/${encodeURIComponent(id)}`, { method: "DELETE", headers: authHeaders() });
  } catch (e) {
    showError(networkError(e));
    return;
  }
  if (!resp.ok) {
    showError(await errorText(resp));
    return;
  }
  setStatus(`Voice ${id} deleted`, "idle");
  await loadVoices();
}

async function addVoice(ev) {
  ev.preventDefault();
  clearError();
  const file = $("voice-file").files[0];
  const clip = file || state.recorded;
  if (!clip) {
    showError("Choose an audio file or record one first.");
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
  setStatus("Adding the voice…", "busy");
  try {
    const resp = await fetch("/v1/voices", { method: "POST", headers: authHeaders(), body: form });
    if (!resp.ok) {
      showError(`Adding the voice failed: ${await errorText(resp)}`);
      return;
    }
    const added = (await resp.json()).id;
    setStatus(`Voice ${added} added`, "idle");
    await loadVoices(added);
  } catch (e) {
    showError(networkError(e));
  } finally {
    $("add-voice").disabled = false;
  }
}

// -- microphone: MediaRecorder, then decoded and sent as 16-bit wav (the server reads wav, not webm)

async function toggleRecording() {
  if (state.recorder) {
    state.recorder.stop();
    return;
  }
  clearError();
  if (!window.isSecureContext || !navigator.mediaDevices || !window.MediaRecorder) {
    showError("The microphone needs a secure page: open this page over https or on localhost / 127.0.0.1.");
    return;
  }
  let stream;
  try {
    stream = await navigator.mediaDevices.getUserMedia({ audio: true });
  } catch (e) {
    showError(`No microphone: ${e.message || e}`);
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
      showError(`The recording could not be decoded: ${e.message || e}`);
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

// -- speech -------------------------------------------------------------------------------------

function requestBody() {
  const body = {
    input: $("text").value,
    voice: $("voice").value,
    response_format: $("format").value,
    greedy: $("greedy").checked,
  };
  const speed = Number($("speed").value || "1");
  if (speed !== 1) body.speed = speed;
  const seedText = $("seed").value.trim();
  body.seed = seedText === "" ? Math.floor(Math.random() * 2 ** 31) : Number(seedText);
  const mode = document.querySelector('input[name="mode"]:checked').value;
  if (mode) body.mode = mode;
  if (mode === "instruct") body.instructions = $("instructions").value;
  if (streams(body)) body.stream_format = "audio";
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
  const body = requestBody();
  if (!body.voice) {
    showError("Pick a voice first, or add one below.");
    return;
  }
  const ctx = audioContext(); // inside the click: allowed to start
  const controller = new AbortController();
  state.controller = controller;
  refreshButtons();
  resetResult();
  setStatus("Synthesizing…", "busy");
  const t0 = performance.now();
  try {
    const resp = await fetch("/v1/audio/speech", {
      method: "POST",
      headers: authHeaders({ "Content-Type": "application/json" }),
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!resp.ok) {
      showError(await errorText(resp));
      return;
    }
    if (body.stream_format) {
      await playStream(resp, body, ctx, t0);
    } else {
      await playWhole(resp, body, ctx, t0);
    }
  } catch (e) {
    if (controller.signal.aborted) {
      if (state.controller === controller) setStatus("Stopped", "stopped"); // else a newer request runs
    } else {
      showError(networkError(e));
    }
  } finally {
    if (state.controller === controller) {
      state.controller = null;
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
    }
    const n = pending.length >> 1;
    if (!n) continue;
    const pcm = new DataView(pending.buffer, pending.byteOffset, 2 * n);
    const f32 = new Float32Array(n);
    for (let i = 0; i < n; i++) f32[i] = pcm.getInt16(2 * i, true) / 32768;
    pending = pending.slice(2 * n);
    if (first === null) {
      first = (performance.now() - t0) / 1000;
      $("stat-first").textContent = seconds(first);
      $("stats").hidden = false;
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
    setStatus(`Playing… ${seconds(samples / rate)} received`, "playing");
  }
  const wall = (performance.now() - t0) / 1000;
  const bytes = new Blob(parts);
  let file = bytes;
  if (body.response_format === "wav") {
    // the streamed header says "length unknown"; the download gets the real sizes
    file = new Blob([wavHeader(rate, 2 * samples), bytes.slice(WAV_HEADER)], { type: "audio/wav" });
  }
  finishResult(file, body, samples / rate, first, wall, rate);
}

async function playWhole(resp, body, ctx, t0) {
  const data = await resp.arrayBuffer();
  const wall = (performance.now() - t0) / 1000;
  const fmt = body.response_format;
  let length = null;
  let rate = PCM_RATE;
  if (fmt === "pcm") {
    length = data.byteLength / 2 / PCM_RATE;
  } else {
    try {
      length = (await ctx.decodeAudioData(data.slice(0))).duration;
    } catch (e) {
      length = null; // the browser cannot decode it; the download still works
    }
  }
  const file = new Blob([data], { type: resp.headers.get("content-type") || "application/octet-stream" });
  finishResult(file, body, length, wall, wall, rate);
  const player = $("player");
  const playable = fmt === "pcm" ? new Blob([wavHeader(PCM_RATE, data.byteLength), data], { type: "audio/wav" }) : file;
  state.playerUrl = URL.createObjectURL(playable);
  player.src = state.playerUrl;
  player.hidden = false;
  try {
    await player.play();
  } catch (e) {
    setStatus("Done: press play", "done");
  }
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

function resetResult() {
  $("stats").hidden = true;
  for (const id of ["stat-first", "stat-length", "stat-rtf", "stat-seed"]) $(id).textContent = "";
  $("download").hidden = true;
  $("player").hidden = true;
  if (state.downloadUrl) URL.revokeObjectURL(state.downloadUrl);
  if (state.playerUrl) URL.revokeObjectURL(state.playerUrl);
  state.downloadUrl = state.playerUrl = null;
}

function finishResult(file, body, length, first, wall, rate) {
  $("stats").hidden = false;
  $("stat-first").textContent = first === null ? "none" : seconds(first);
  $("stat-length").textContent = length === null ? "?" : seconds(length);
  $("stat-rtf").textContent = length ? (wall / length).toFixed(2) : "?";
  $("stat-seed").textContent = String(body.seed);
  state.downloadUrl = URL.createObjectURL(file);
  const a = $("download");
  a.href = state.downloadUrl;
  a.download = `speech-${body.voice}-${body.seed}.${body.response_format}`;
  a.hidden = false;
  if (state.playing === 0) {
    setStatus(length === 0 ? "Done (no audio)" : "Done", "done");
  }
}

function stopPlayback() {
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
  $("player").pause();
  refreshButtons();
}

function stop() {
  const controller = state.controller;
  stopPlayback();
  if (controller) {
    controller.abort(); // the server sees the client go and frees the request's sequence
  }
  setStatus("Stopped", "stopped");
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
  let hint = "";
  if ($("stream").checked && !(fmt === "wav" || fmt === "pcm")) {
    hint = `${fmt} is fetched whole and played when done; streamed playback takes wav or pcm.`;
  } else if ($("stream").checked && speed !== 1) {
    hint = "A speed other than 1 applies to the finished audio: this request is not streamed.";
  }
  $("stream-hint").textContent = hint;
  $("stream-hint").hidden = !hint;
}

function init() {
  const key = sessionStorage.getItem(KEY_STORE);
  if (key) $("api-key").value = key;
  $("api-key").addEventListener("change", () => {
    const value = $("api-key").value.trim();
    if (value) sessionStorage.setItem(KEY_STORE, value);
    else sessionStorage.removeItem(KEY_STORE);
    clearError();
    loadVoices();
  });
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
    }
  });
  for (const el of document.querySelectorAll('input[name="mode"], #voice, #format, #speed, #stream')) {
    el.addEventListener("change", updateForm);
  }
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
  $("text").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) $("speak-form").requestSubmit();
  });
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
