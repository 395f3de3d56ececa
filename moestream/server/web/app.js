// moestream's page: a chat with the served model (OpenAI chat completions, streamed) and a live view of
// the engine drawn from /v1/stats/stream (the /v1/stats body, pushed at each snapshot refresh).
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);
  const KEY_STORE = "moestream.apiKey";
  const HISTORY = 240; // samples kept per chart (2 minutes at 0.5 s)
  const GiB = 1024 ** 3;

  const app = {
    key: sessionStorage.getItem(KEY_STORE) || "",
    keyRequired: false,
    model: null,
    contextLength: null,
    history: [], // chat messages sent to the model
    abort: null, // AbortController of the request in flight
    stats: null, // the last /v1/stats body
    prev: null, // the body before it (rates are differences of counters)
    series: { decode: [], prefill: [], hit: [], pcie: [], cpu: [] },
    statsEvents: 0,
    heatMaxHits: 0, // the most hits of one expert in the heat map (its brightest cell)
  };
  window.moestreamPage = app; // for tests and for curious people in the console

  // ---- API key ---------------------------------------------------------------------------------
  let keyWaiters = [];
  function askKey(message) {
    $("key-error").textContent = message || "";
    $("key-input").value = "";
    $("key-dialog").hidden = false;
    $("key-input").focus();
    return new Promise((resolve, reject) => keyWaiters.push({ resolve, reject }));
  }
  function closeKey(ok) {
    $("key-dialog").hidden = true;
    const waiters = keyWaiters;
    keyWaiters = [];
    for (const w of waiters) ok ? w.resolve(app.key) : w.reject(new Error("no API key given"));
  }
  $("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    app.key = $("key-input").value.trim();
    sessionStorage.setItem(KEY_STORE, app.key);
    closeKey(true);
    if (statsCtl) restartStats(); // (at start-up, start() opens the stream once the key is in)
  });
  $("key-cancel").addEventListener("click", () => closeKey(false));
  $("key-button").addEventListener("click", () => askKey("").then(loadModel).catch(() => {}));

  function headers(extra) {
    const h = Object.assign({}, extra || {});
    if (app.key) h["Authorization"] = "Bearer " + app.key;
    return h;
  }

  // fetch with the key; a 401 asks for the key once and retries
  async function api(path, opts) {
    opts = opts || {};
    for (let attempt = 0; ; attempt++) {
      const resp = await fetch(path, Object.assign({}, opts, { headers: headers(opts.headers) }));
      if (resp.status !== 401 || attempt > 0) return resp;
      await askKey(app.key ? "That key was not accepted." : "");
    }
  }

  async function errorText(resp) {
    try {
      const body = await resp.json();
      return (body.error && body.error.message) || JSON.stringify(body);
    } catch (e) {
      return resp.status + " " + resp.statusText;
    }
  }

  // ---- model info ------------------------------------------------------------------------------
  async function loadModel() {
    const resp = await api("/v1/models");
    if (!resp.ok) throw new Error(await errorText(resp));
    const card = (await resp.json()).data[0];
    app.model = card.id;
    app.contextLength = card.context_length || card.max_model_len;
    $("model-name").textContent = card.id;
    $("model-ctx").textContent = app.contextLength ? "context " + app.contextLength.toLocaleString() + " tokens" : "";
    document.title = "moestream · " + card.id;
  }

  // ---- server-sent events over fetch (EventSource cannot send the Authorization header) ---------
  async function* sse(resp) {
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buf += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const block = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).replace(/^ /, ""));
        if (data.length) yield data.join("\n");
      }
    }
  }

  // ---- chat ------------------------------------------------------------------------------------
  function num(id, parse) {
    const v = $(id).value.trim();
    if (v === "") return undefined;
    const n = (parse || parseFloat)(v);
    return Number.isFinite(n) ? n : undefined;
  }

  function requestBody() {
    const messages = [];
    const system = $("set-system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    const body = {
      model: app.model || undefined, messages: messages.concat(app.history), stream: true,
      stream_options: { include_usage: true },
      temperature: num("set-temperature"), top_p: num("set-top-p"), max_tokens: num("set-max-tokens", (v) => parseInt(v, 10)),
    };
    const topK = num("set-top-k", (v) => parseInt(v, 10));
    if (topK !== undefined && topK >= 0) body.top_k = topK;
    const seed = num("set-seed", (v) => parseInt(v, 10));
    if (seed !== undefined) body.seed = seed;
    if ($("set-ignore-eos").checked) body.ignore_eos = true;
    const tools = $("set-tools").value.trim();
    if (tools) {
      try { body.tools = JSON.parse(tools); } catch (e) { throw new Error("the tools setting is not valid JSON: " + e.message); }
    }
    return body;
  }

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function addMessage(role, text) {
    const box = el("div", "msg " + role);
    box.dataset.role = role;
    if (role === "user") box.textContent = text;
    $("messages").appendChild(box);
    $("empty-hint").hidden = true;
    box.scrollIntoView({ block: "end" });
    return box;
  }

  // One assistant answer being streamed: reasoning (folded), tool calls, markdown content, footer.
  class Answer {
    constructor() {
      this.box = addMessage("assistant");
      this.reasoning = "";
      this.content = "";
      this.calls = [];
      this.reasoningBox = null;
      this.callsBox = el("div", "calls");
      this.body = el("div", "body cursor");
      this.foot = el("div", "foot");
      this.box.append(this.body, this.callsBox, this.foot); // calls come after the text that leads to them
      this.pending = false;
    }
    delta(d) {
      if (d.reasoning_content) this.reasoning += d.reasoning_content;
      if (d.content) this.content += d.content;
      for (const tc of d.tool_calls || []) {
        const i = tc.index || 0;
        const call = this.calls[i] || (this.calls[i] = { id: tc.id, type: "function", function: { name: "", arguments: "" } });
        if (tc.id) call.id = tc.id;
        if (tc.function && tc.function.name) call.function.name += tc.function.name;
        if (tc.function && tc.function.arguments) call.function.arguments += tc.function.arguments;
      }
      this.schedule();
    }
    schedule() {
      if (this.pending) return;
      this.pending = true;
      requestAnimationFrame(() => { this.pending = false; this.draw(); });
    }
    draw() {
      if (this.reasoning) {
        if (!this.reasoningBox) {
          this.reasoningBox = el("details", "reasoning");
          this.reasoningBox.append(el("summary"), el("div", "thought"));
          this.box.insertBefore(this.reasoningBox, this.body);
        }
        this.reasoningBox.querySelector("summary").textContent = "Reasoning (" + this.reasoning.length + " characters)";
        this.reasoningBox.querySelector(".thought").textContent = this.reasoning;
      }
      this.callsBox.replaceChildren(...this.calls.filter(Boolean).map((c) => {
        const box = el("div", "toolcall");
        box.append(el("span", "", "tool call "), el("span", "name", c.function.name));
        let args = c.function.arguments;
        try { args = JSON.stringify(JSON.parse(args), null, 2); } catch (e) { /* still streaming: as is */ }
        box.append(el("pre", "", args));
        return box;
      }));
      this.body.replaceChildren(window.MoestreamMarkdown.render(this.content));
      const box = $("messages");
      if (box.scrollHeight - box.scrollTop - box.clientHeight < 80) box.scrollTop = box.scrollHeight;
    }
    finish(text, cls) {
      this.draw();
      this.body.classList.remove("cursor");
      this.foot.textContent = text;
      if (cls) this.foot.classList.add(cls);
      this.box.dataset.done = cls || "done";
    }
  }

  async function send(text) {
    app.history.push({ role: "user", content: text });
    addMessage("user", text);
    const answer = new Answer();
    const ctl = new AbortController();
    app.abort = ctl;
    setBusy(true);
    const t0 = performance.now();
    let first = null, finish = null, usage = null, error = null;
    try {
      const resp = await api("/v1/chat/completions", {
        method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(requestBody()),
        signal: ctl.signal,
      });
      if (!resp.ok) throw new Error(await errorText(resp));
      for await (const data of sse(resp)) {
        if (data === "[DONE]") break;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message || "the server reported an error");
        if (chunk.usage) usage = chunk.usage;
        for (const ch of chunk.choices || []) {
          if (first === null && (ch.delta.content || ch.delta.reasoning_content)) first = performance.now();
          answer.delta(ch.delta);
          if (ch.finish_reason) finish = ch.finish_reason;
        }
      }
    } catch (e) {
      if (e.name !== "AbortError") error = e;
    } finally {
      app.abort = null;
      setBusy(false);
    }
    const secs = (performance.now() - t0) / 1000;
    if (ctl.signal.aborted) {
      answer.finish("stopped after " + secs.toFixed(1) + " s (the request was aborted on the server)", "stopped");
    } else if (error) {
      answer.finish("error: " + error.message, "stopped");
      answer.box.classList.add("error");
    } else {
      const parts = ["finish: " + (finish || "?")];
      if (usage) {
        parts.push(usage.prompt_tokens + " prompt + " + usage.completion_tokens + " generated tokens");
        if (first !== null && usage.completion_tokens > 1) {
          parts.push(((usage.completion_tokens - 1) / ((performance.now() - first) / 1000)).toFixed(1) + " tok/s");
        }
      }
      if (first !== null) parts.push("first token " + ((first - t0) / 1000).toFixed(2) + " s");
      answer.finish(parts.join(" · "));
    }
    const reply = { role: "assistant", content: answer.content };
    const calls = answer.calls.filter(Boolean);
    if (calls.length) reply.tool_calls = calls;
    if (answer.content || calls.length) app.history.push(reply);
  }

  function setBusy(busy) {
    $("send").disabled = busy;
    $("stop").disabled = !busy;
    $("chat-status").textContent = busy ? "generating…" : "";
  }

  $("composer").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || app.abort) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => { if (app.abort) app.abort.abort(); });
  $("clear").addEventListener("click", () => {
    if (app.abort) app.abort.abort();
    app.history = [];
    $("messages").replaceChildren();
    $("empty-hint").hidden = false;
  });

  // ---- live statistics -------------------------------------------------------------------------
  let statsCtl = null;
  function restartStats() {
    if (statsCtl) statsCtl.abort();
    statsCtl = new AbortController();
    streamStats(statsCtl.signal);
  }

  async function streamStats(signal) {
    const conn = $("conn");
    while (!signal.aborted) {
      try {
        const resp = await fetch("/v1/stats/stream", { headers: headers(), signal });
        if (resp.status === 401) {
          conn.textContent = "stats: need the API key";
          conn.className = "conn down";
          return; // the key dialog restarts the stream
        }
        if (!resp.ok) throw new Error(resp.status);
        conn.textContent = "stats: live";
        conn.className = "conn live";
        for await (const data of sse(resp)) onStats(JSON.parse(data));
      } catch (e) {
        if (signal.aborted) return;
      }
      conn.textContent = "stats: reconnecting";
      conn.className = "conn down";
      await new Promise((r) => setTimeout(r, 2000));
    }
  }

  function fmt(v, digits) {
    if (v === null || v === undefined || !Number.isFinite(v)) return "–";
    return v.toLocaleString(undefined, { maximumFractionDigits: digits === undefined ? 1 : digits,
                                         minimumFractionDigits: digits === undefined ? 1 : digits });
  }
  function pct(v) { return v === null || v === undefined ? "–" : (100 * v).toFixed(1) + "%"; }

  function cpuBytes(experts) {
    if (!experts || !experts.layers) return null;
    const per = experts.bytes_per_expert || {};
    let total = 0;
    for (const [layer, s] of Object.entries(experts.layers)) total += (s.cpu_experts || 0) * (per[layer] || 0);
    return total;
  }

  function rate(now, before, pick) {
    if (!before || now.snapshot_at === null || before.snapshot_at === null) return null;
    const dt = now.snapshot_at - before.snapshot_at;
    const a = pick(now), b = pick(before);
    if (!(dt > 0) || a === null || b === null) return null;
    return Math.max(0, a - b) / dt;
  }

  function onStats(s) {
    if (app.stats && s.snapshot_at === app.stats.snapshot_at) return;
    app.prev = app.stats;
    app.stats = s;
    app.statsEvents++;
    const tp = s.throughput || {};
    const ex = s.experts && s.experts.num_experts > 0 && Object.keys(s.experts.layers || {}).length ? s.experts : null;
    const hit = ex ? (ex.recent_hit_rate ?? s.experts_hit_rate ?? null) : null;
    const pcie = ex ? rate(s, app.prev, (x) => (x.experts && x.experts.total ? x.experts.total.bytes_h2d : null)) : null;
    const cpu = ex ? rate(s, app.prev, (x) => cpuBytes(x.experts)) : null;

    push("decode", tp.decode_tps ?? null);
    push("prefill", tp.prefill_tps ?? null);
    push("hit", hit);
    push("pcie", pcie === null ? null : pcie / 1e9);
    push("cpu", cpu === null ? null : cpu / 1e9);

    $("v-decode").textContent = fmt(tp.decode_tps);
    $("v-prefill").textContent = fmt(tp.prefill_tps);
    $("v-reqs").textContent = (s.running ?? 0) + " / " + (s.queued ?? 0);
    $("v-kv").textContent = s.kv ? s.kv.used_pages + " / " + s.kv.total_pages : "–";
    $("v-hit").textContent = ex ? pct(hit) : "dense";
    $("v-pcie").textContent = ex ? fmt(pcie === null ? null : pcie / 1e9, 2) : "–";
    $("v-cpu").textContent = ex ? fmt(cpu === null ? null : cpu / 1e9, 2) : "–";
    const totals = s.engine_totals || {};
    $("v-gen").textContent = (totals.generated_tokens ?? 0).toLocaleString();
    $("v-done").textContent = (totals.finished ?? 0) + " / " + (totals.aborted ?? 0);

    const eng = s.engine || {};
    $("engine-info").textContent = [eng.device, eng.dtype, eng.expert_backend && ex ? "experts: " + eng.expert_backend : null,
                                    eng.architecture].filter(Boolean).join(" · ");
    if (!app.model && s.model) $("model-name").textContent = s.model;

    drawCharts();
    drawPlan(s.memory_plan);
    drawHeat(ex);
  }

  function push(name, v) {
    const a = app.series[name];
    a.push(v);
    if (a.length > HISTORY) a.shift();
  }

  // ---- drawing ---------------------------------------------------------------------------------
  function css(name) { return getComputedStyle(document.documentElement).getPropertyValue(name).trim(); }

  function canvasFor(c, height) {
    const dpr = window.devicePixelRatio || 1;
    const w = c.clientWidth || 300, h = height || c.clientHeight || 110;
    if (c.width !== Math.round(w * dpr) || c.height !== Math.round(h * dpr)) {
      c.width = Math.round(w * dpr);
      c.height = Math.round(h * dpr);
    }
    const ctx = c.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    return { ctx, w, h };
  }

  function chart(id, lines, fixedMax, unit) {
    const { ctx, w, h } = canvasFor($(id));
    const pad = { l: 44, r: 8, t: 8, b: 6 };
    let max = fixedMax || 0;
    if (!fixedMax) for (const l of lines) for (const v of l.values) if (v !== null && v > max) max = v;
    if (!fixedMax) max = niceMax(max);
    ctx.font = "11px system-ui, sans-serif";
    ctx.fillStyle = css("--dim");
    ctx.strokeStyle = css("--line");
    ctx.lineWidth = 1;
    for (const f of [0, 0.5, 1]) {
      const y = pad.t + (h - pad.t - pad.b) * (1 - f);
      ctx.beginPath();
      ctx.moveTo(pad.l, y + 0.5);
      ctx.lineTo(w - pad.r, y + 0.5);
      ctx.stroke();
      ctx.fillText(label(max * f, unit), 4, y + 4);
    }
    const dx = (w - pad.l - pad.r) / (HISTORY - 1);
    for (const l of lines) {
      ctx.strokeStyle = css(l.color);
      ctx.lineWidth = 1.6;
      ctx.beginPath();
      let pen = false;
      const off = HISTORY - l.values.length;
      l.values.forEach((v, i) => {
        if (v === null) { pen = false; return; }
        const x = pad.l + (off + i) * dx, y = pad.t + (h - pad.t - pad.b) * (1 - Math.min(v / (max || 1), 1));
        pen ? ctx.lineTo(x, y) : ctx.moveTo(x, y);
        pen = true;
      });
      ctx.stroke();
    }
  }

  function niceMax(v) {
    if (!(v > 0)) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
    return 10 * p;
  }
  function label(v, unit) {
    if (unit === "%") return Math.round(v * 100) + "%";
    if (v === 0) return "0";
    return v >= 10 ? Math.round(v).toString() : v >= 1 ? v.toFixed(1) : Number(v.toPrecision(2)).toString();
  }

  function drawCharts() {
    chart("chart-tps", [{ values: app.series.prefill, color: "--prefill" }, { values: app.series.decode, color: "--decode" }]);
    chart("chart-hit", [{ values: app.series.hit, color: "--hit" }], 1, "%");
    chart("chart-bw", [{ values: app.series.pcie, color: "--pcie" }, { values: app.series.cpu, color: "--cpu" }]);
  }

  const PLAN_PARTS = [["dense", "dense weights", "--dense"], ["kv", "KV cache", "--kv"],
                      ["experts_device", "expert slots", "--experts"], ["prefill_buffer", "prefill buffer", "--prefillbuf"],
                      ["state", "linear state", "--state"], ["workspace", "workspace", "--workspace"]];
  let planKey = null;
  function drawPlan(plan) {
    const key = JSON.stringify(plan || null);
    if (key === planKey) return;
    planKey = key;
    const bar = $("plan-bar"), legend = $("plan-legend");
    if (!plan || !plan.bytes) {
      bar.replaceChildren();
      legend.replaceChildren(el("span", "", "no memory plan reported by this engine"));
      $("plan-text").textContent = "";
      return;
    }
    const b = plan.bytes;
    const used = PLAN_PARTS.reduce((sum, [k]) => sum + (b[k] || 0), 0);
    const whole = Math.max(b.budget || 0, used) || 1;
    const segs = [], keys = [];
    for (const [k, name, color] of PLAN_PARTS) {
      if (!b[k]) continue;
      const seg = el("div");
      seg.style.width = (100 * b[k] / whole) + "%";
      seg.style.background = css(color);
      seg.title = name + ": " + (b[k] / GiB).toFixed(2) + " GiB";
      segs.push(seg);
      const item = el("span");
      const sw = el("i");
      sw.style.background = css(color);
      item.append(sw, document.createTextNode(name + " " + (b[k] / GiB).toFixed(2) + " GiB"));
      keys.push(item);
    }
    if (whole > used) keys.push(el("span", "", "unused " + ((whole - used) / GiB).toFixed(2) + " GiB"));
    bar.replaceChildren(...segs);
    legend.replaceChildren(...keys);
    $("plan-text").textContent = plan.device + " budget " + ((b.budget || 0) / GiB).toFixed(2) + " GiB · " +
      (plan.total_experts ? "experts: " + plan.backend + ", " + plan.cache_slots + " of " + plan.total_experts + " slots"
                          : "dense model") +
      (plan.kv_tokens ? " · KV " + plan.kv_tokens.toLocaleString() + " tokens" : "");
  }

  function drawHeat(ex) {
    const canvas = $("heatmap"), note = $("heat-note");
    if (!ex) {
      note.textContent = "This model has no routed experts (a dense model): nothing to place.";
      canvas.hidden = true;
      return;
    }
    canvas.hidden = false;
    const layers = Object.keys(ex.layers).sort((a, b) => a - b);
    const E = ex.num_experts;
    const map = (ex.cache && ex.cache.resident_map) || null;
    note.textContent = map ? layers.length + " MoE layers × " + E + " experts; " + (ex.cache.resident || 0) + " of " +
      (ex.cache.slots || 0) + " slots hold an expert" :
      ex.backend === "fused" ? "fused: every expert is resident in device memory" :
      "backend " + ex.backend + ": experts are computed from host memory, none is cached on the device";
    const rowH = Math.max(3, Math.min(14, Math.floor(420 / layers.length)));
    const { ctx, w, h } = canvasFor(canvas, rowH * layers.length + 2);
    canvas.style.height = h + "px";
    const hitW = 18, gridW = w - hitW - 6;
    const cw = gridW / E;
    const cold = "#1f262f";
    const hits = ex.expert_hits || null; // per layer, hits of each expert: the cells' brightness
    let top = 0;
    if (hits) for (const l of layers) for (const v of hits[l] || []) top = Math.max(top, v);
    app.heatMaxHits = top;
    const shade = (v) => top > 0 ? Math.log1p(v) / Math.log1p(top) : 0;
    layers.forEach((layer, r) => {
      const y = 1 + r * rowH;
      const row = map ? map[layer] || "" : null;
      const hrow = hits ? hits[layer] || [] : null;
      for (let e = 0; e < E; e++) {
        const c = row ? row.charCodeAt(e) - 48 : ex.backend === "fused" ? 5 : 0;
        const resident = c > 0 && c <= 9;
        if (hrow && top > 0) { // hits known: brightness by hits, hue by residency
          const f = shade(hrow[e] || 0);
          ctx.fillStyle = resident ? heat(0.1 + 0.9 * f) : gray(f);
        } else {
          ctx.fillStyle = resident ? heat(c / 9) : cold;
        }
        ctx.fillRect(e * cw, y, Math.max(cw - (cw > 3 ? 0.5 : 0), 0.5), rowH - (rowH > 4 ? 1 : 0));
      }
      const st = ex.layers[layer];
      const n = (st.hits || 0) + (st.misses || 0);
      ctx.fillStyle = n ? hitColor(st.hits / n) : cold;
      ctx.fillRect(gridW + 6, y, hitW, rowH - (rowH > 4 ? 1 : 0));
    });
  }
  function heat(f) { // dim teal to bright yellow-green
    const a = [24, 90, 80], b = [220, 250, 110];
    return "rgb(" + a.map((v, i) => Math.round(v + (b[i] - v) * f)).join(",") + ")";
  }
  function gray(f) { // not resident: dark slate, lighter the more it was hit
    const a = [31, 38, 47], b = [120, 132, 150];
    return "rgb(" + a.map((v, i) => Math.round(v + (b[i] - v) * f)).join(",") + ")";
  }
  function hitColor(f) {
    const a = [224, 108, 117], b = [63, 207, 142];
    return "rgb(" + a.map((v, i) => Math.round(v + (b[i] - v) * f)).join(",") + ")";
  }
  window.addEventListener("resize", () => { if (app.stats) { drawCharts(); drawHeat(app.stats.experts && app.stats.experts.num_experts ? app.stats.experts : null); } });

  // ---- start -----------------------------------------------------------------------------------
  async function start() {
    try {
      const health = await (await fetch("/health")).json();
      app.keyRequired = !!health.api_key_required;
      if (health.model) $("model-name").textContent = health.model;
    } catch (e) { /* the model call below reports it */ }
    if (app.keyRequired && !app.key) {
      try { await askKey(""); } catch (e) { /* cancelled: the page stays usable once a key is given */ }
    }
    restartStats();
    try {
      await loadModel();
    } catch (e) {
      $("chat-status").textContent = "could not read the model: " + e.message;
    }
  }
  start();
})();
