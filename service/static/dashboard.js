"use strict";
// The KV dashboard: polls the gateway's /v1/kv_snapshot (the API key as a Bearer token) twice a second
// and draws the engine's KV pools one cell per block, its counters, a usage chart and its requests.
(() => {
  const FREE = 0, CACHED = 1, SHARED = 3, COW = 4;  // block states (engine/core/kv_snapshot.py); 2 is used
  const STATE_NAMES = ["free", "free, prefix-cached", "used", "shared", "shared, copy-on-write"];
  const NO_OWNER = 0xffff;
  const POLL_MS = 500;
  const HISTORY_S = 120;
  const MAX_ROWS = 300;
  const KEY_ITEM = "pagedserve-api-key";
  const COLOURS = {free: "#e5e7eb", cached: "#bae6fd", ink: "#111827", cow: "#ea580c", unowned: "#9ca3af",
                   image: "#db2777"};
  const $ = (id) => document.getElementById(id);

  const view = {key: null, engine: null, snapshot: null, hover: null, history: [], timer: 0, layouts: {}};

  // ---- the API key: from the URL fragment (#key=..., never sent to the server), else the form;
  // kept in sessionStorage for this tab only.
  function readKey() {
    const fragment = new URLSearchParams(location.hash.slice(1));
    if (fragment.has("key")) {
      sessionStorage.setItem(KEY_ITEM, fragment.get("key"));
      history.replaceState(null, "", location.pathname + location.search);
    }
    return sessionStorage.getItem(KEY_ITEM);
  }

  function askForKey(message) {
    $("key-form").hidden = false;
    $("key").focus();
    setStatus("error", message);
  }

  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    view.key = $("key").value.trim();
    sessionStorage.setItem(KEY_ITEM, view.key);
    $("key-form").hidden = true;
    poll();
  });

  function setStatus(state, text) {
    const status = $("status");
    status.dataset.state = state;
    status.textContent = text;
  }

  // ---- polling ------------------------------------------------------------------------------------------
  async function poll() {
    clearTimeout(view.timer);
    if ($("pause").checked) return;
    const url = new URL("/v1/kv_snapshot", location.origin);
    if (view.engine) url.searchParams.set("engine", view.engine);
    const headers = view.key ? {Authorization: `Bearer ${view.key}`} : {};
    try {
      const response = await fetch(url, {headers, cache: "no-store"});
      const body = await response.json().catch(() => ({}));
      if (response.status === 401) return askForKey("the gateway wants an API key");
      if (!response.ok) throw new Error(body.error?.message || `HTTP ${response.status}`);
      showEngines(body.engines, body.engine);
      if (body.snapshot) {
        show(decode(body.snapshot));
      } else {
        setStatus("waiting", `${body.engine}: waiting for its first snapshot`);
      }
    } catch (error) {
      setStatus("error", error.message || String(error));
    }
    view.timer = setTimeout(poll, POLL_MS);
  }

  function showEngines(engines, current) {
    const select = $("engine");
    if ([...select.options].map((o) => o.value).join() !== engines.join()) {
      select.replaceChildren(...engines.map((id) => new Option(id, id)));
    }
    select.value = current;
    view.engine = current;
  }

  $("engine").addEventListener("change", (event) => {
    view.engine = event.target.value;
    view.history = [];
    view.hover = null;
    poll();
  });
  $("pause").addEventListener("change", () => poll());

  // ---- decoding: arrays arrive as base64 of little-endian bytes -------------------------------------------
  function bytes(text) {
    const raw = atob(text);
    const out = new Uint8Array(raw.length);
    for (let i = 0; i < raw.length; i++) out[i] = raw.charCodeAt(i);
    return out;
  }

  function littleEndian(text, size) {
    const raw = bytes(text);
    const data = new DataView(raw.buffer);
    const out = size === 2 ? new Uint16Array(raw.length / 2) : new Uint32Array(raw.length / 4);
    for (let i = 0; i < out.length; i++) out[i] = size === 2 ? data.getUint16(2 * i, true) : data.getUint32(4 * i, true);
    return out;
  }

  function decodePool(pool) {
    return {size: pool.num_blocks, state: bytes(pool.state), ref: littleEndian(pool.ref_count, 2),
            owner: littleEndian(pool.owner, 2), filled: littleEndian(pool.filled, 2),
            computed: littleEndian(pool.computed, 2)};
  }

  function decode(snapshot) {
    const requests = snapshot.requests.map((r) => ({...r, blocks: littleEndian(r.blocks, 4),
                                                     imageBlocks: littleEndian(r.image_blocks || "", 4)}));
    requests.forEach((r) => { r.colour = colourOf(r.id); });
    return {...snapshot, device: decodePool(snapshot.device), cpu: decodePool(snapshot.cpu), requests};
  }

  // A request keeps its colour from snapshot to snapshot: the hue comes from its id (FNV-1a).
  function colourOf(id) {
    let hash = 0x811c9dc5;
    for (let i = 0; i < id.length; i++) hash = Math.imul(hash ^ id.charCodeAt(i), 0x01000193);
    const hue = (hash >>> 0) % 360;
    return {solid: `hsl(${hue} 65% 45%)`, light: `hsl(${hue} 65% 70%)`, pale: `hsl(${hue} 60% 90%)`};
  }

  // ---- drawing ------------------------------------------------------------------------------------------
  function show(snapshot) {
    const previous = view.snapshot;
    view.snapshot = snapshot;
    if (!previous || previous.time !== snapshot.time) record(snapshot);
    if (view.hover && !snapshot.requests.some((r) => r.id === view.hover)) view.hover = null;
    drawPools();
    showCounters(snapshot.stats);
    drawChart();
    listRequests(snapshot.requests);
    setStatus("live", `${snapshot.engine_id} · ${snapshot.model} · snapshot ${snapshot.age_s.toFixed(1)} s old`);
  }

  function drawPools() {
    const s = view.snapshot;
    if (!s) return;
    const hovered = s.requests.find((r) => r.id === view.hover);
    const inCpu = hovered?.state === "swapped";
    drawGrid("device-grid", s.device, s, hovered && !inCpu ? new Set(hovered.blocks) : hovered ? new Set() : null);
    $("cpu-pool").hidden = s.cpu.size === 0;
    if (s.cpu.size) drawGrid("cpu-grid", s.cpu, s, hovered && inCpu ? new Set(hovered.blocks) : hovered ? new Set() : null);
    $("device-summary").textContent = summary(s.device);
    $("cpu-summary").textContent = summary(s.cpu);
  }

  function summary(pool) {
    const used = countHeld(pool);
    return `${used} of ${pool.size} used, ${pool.size - used} free`;
  }

  function countHeld(pool) {
    let used = 0;
    for (let i = 0; i < pool.size; i++) used += pool.state[i] > CACHED;
    return used;
  }

  // Cells as large as fit the pool in about 420 px of height, 3 to 22 px a side.
  function layout(canvas, size) {
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth || 600;
    const cell = Math.max(3, Math.min(22, Math.floor(Math.sqrt((width * 420) / Math.max(size, 1)))));
    const columns = Math.max(1, Math.floor(width / cell));
    const rows = Math.max(1, Math.ceil(size / columns));
    canvas.style.height = `${rows * cell}px`;
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(rows * cell * ratio);
    return {cell: cell * ratio, columns, gap: cell >= 8 ? ratio : 0};
  }

  function cellBox(geometry, i) {
    const x = (i % geometry.columns) * geometry.cell, y = Math.floor(i / geometry.columns) * geometry.cell;
    return {x, y, size: geometry.cell - geometry.gap};
  }

  // The blocks of one pool that hold image tokens (a swapped request's are in the CPU pool).
  function imageBlocks(snapshot, cpu) {
    const blocks = new Set();
    for (const r of snapshot.requests) {
      if ((r.state === "swapped") === cpu) r.imageBlocks.forEach((b) => blocks.add(b));
    }
    return blocks;
  }

  function drawGrid(id, pool, snapshot, highlight) {
    const canvas = $(id);
    const images = imageBlocks(snapshot, id === "cpu-grid");
    const geometry = view.layouts[id] = layout(canvas, pool.size);
    const ctx = canvas.getContext("2d");
    const bs = snapshot.block_size, line = Math.max(1, Math.floor(geometry.cell / 8));
    ctx.fillStyle = "#fff";  // dimmed cells fade into it
    ctx.fillRect(0, 0, canvas.width, canvas.height);
    let used = 0, cached = 0;
    for (let i = 0; i < pool.size; i++) {
      const {x, y, size} = cellBox(geometry, i);
      const state = pool.state[i];
      ctx.globalAlpha = highlight && !highlight.has(i) ? 0.2 : 1;
      if (state === FREE || state === CACHED) {
        ctx.fillStyle = state === FREE ? COLOURS.free : COLOURS.cached;
        ctx.fillRect(x, y, size, size);
        cached += state === CACHED;
        continue;
      }
      used++;
      const owner = pool.owner[i] === NO_OWNER ? null : snapshot.requests[pool.owner[i]];
      const colour = owner ? owner.colour : {solid: COLOURS.unowned, light: COLOURS.unowned, pale: COLOURS.free};
      const filled = (size * pool.filled[i]) / bs, computed = (size * pool.computed[i]) / bs;
      ctx.fillStyle = colour.pale;  // the block's empty slots
      ctx.fillRect(x, y, size, size);
      ctx.fillStyle = colour.light;  // reserved for this step, K/V not written yet
      ctx.fillRect(x, y + size - filled, size, filled - computed);
      ctx.fillStyle = colour.solid;
      ctx.fillRect(x, y + size - computed, size, computed);
      if (state === SHARED || state === COW) outline(ctx, x, y, size, state === COW ? COLOURS.cow : COLOURS.ink, line);
      if (images.has(i)) {  // image tokens: a corner mark
        ctx.fillStyle = COLOURS.image;
        ctx.beginPath();
        ctx.moveTo(x + size, y);
        ctx.lineTo(x + size, y + size / 2);
        ctx.lineTo(x + size / 2, y);
        ctx.fill();
      }
    }
    ctx.globalAlpha = 1;
    for (const i of highlight || []) {
      const {x, y, size} = cellBox(geometry, i);
      outline(ctx, x, y, size, COLOURS.ink, Math.max(2, line + 1));
    }
    canvas.dataset.blocks = pool.size;
    canvas.dataset.used = used;
    canvas.dataset.cached = cached;
    canvas.dataset.images = [...images].sort((a, b) => a - b).join(",");
    canvas.dataset.highlighted = highlight ? [...highlight].sort((a, b) => a - b).join(",") : "";
  }

  function outline(ctx, x, y, size, colour, width) {
    ctx.strokeStyle = colour;
    ctx.lineWidth = width;
    ctx.strokeRect(x + width / 2, y + width / 2, size - width, size - width);
  }

  function showCounters(stats) {
    const percent = (x) => `${(100 * x).toFixed(1)}%`;
    const used = stats.num_blocks_used;
    const counters = {
      running: stats.num_requests_running, waiting: stats.num_requests_waiting,
      swapped: stats.num_requests_swapped, preemptions: stats.num_preemptions_total,
      usage: `${used}/${stats.num_blocks_total}`, cached: stats.num_blocks_cached,
      "hit-rate": stats.prefix_cache_queries_total
        ? percent(stats.prefix_cache_hits_total / stats.prefix_cache_queries_total) : "-",
      waste: used ? percent(1 - stats.kv_token_utilization) : "-",
      state: stats.num_state_slots_total  // a hybrid model's recurrent-state slots, and its snapshots
        ? `${stats.num_state_slots_used}/${stats.num_state_slots_total} + ${stats.num_state_snapshots_used}` : "-",
    };
    for (const [name, value] of Object.entries(counters)) {
      document.querySelector(`[data-counter="${name}"]`).textContent = value;
    }
  }

  // ---- the chart: blocks used and waste (empty or reserved slots of used blocks), % --------------------
  function record(snapshot) {
    const stats = snapshot.stats;
    view.history.push({time: snapshot.time, usage: stats.kv_cache_usage,
                       waste: stats.num_blocks_used ? 1 - stats.kv_token_utilization : 0});
    while (view.history.length && view.history[0].time < snapshot.time - HISTORY_S) view.history.shift();
    $("chart").dataset.points = view.history.length;
  }

  function drawChart() {
    const canvas = $("chart");
    const ratio = window.devicePixelRatio || 1;
    const width = (canvas.width = Math.round((canvas.clientWidth || 600) * ratio));
    const height = (canvas.height = Math.round(160 * ratio));
    const ctx = canvas.getContext("2d");
    const end = view.history.length ? view.history[view.history.length - 1].time : 0;
    const x = (time) => width - ((end - time) / HISTORY_S) * width;
    const y = (fraction) => height - 4 * ratio - fraction * (height - 8 * ratio);
    ctx.strokeStyle = COLOURS.free;
    ctx.lineWidth = ratio;
    for (const level of [0, 0.5, 1]) {
      ctx.beginPath();
      ctx.moveTo(0, y(level));
      ctx.lineTo(width, y(level));
      ctx.stroke();
    }
    for (const [key, colour] of [["usage", "#4f46e5"], ["waste", COLOURS.cow]]) {
      ctx.strokeStyle = colour;
      ctx.lineWidth = 2 * ratio;
      ctx.beginPath();
      view.history.forEach((point, i) => (i ? ctx.lineTo : ctx.moveTo).call(ctx, x(point.time), y(point[key])));
      ctx.stroke();
    }
  }

  // ---- the request list; hovering a row highlights its blocks ------------------------------------------
  function listRequests(requests) {
    const rows = requests.slice(0, MAX_ROWS).map((r) => {
      const row = document.createElement("tr");
      row.dataset.id = r.id;
      row.dataset.state = r.state;
      row.classList.toggle("hover", r.id === view.hover);
      const pool = r.state === "swapped" ? view.snapshot.cpu : view.snapshot.device;
      const shared = r.blocks.reduce((n, b) => n + (pool.ref[b] > 1), 0);
      const swatch = document.createElement("i");
      swatch.style.background = r.colour.solid;
      row.append(cell(swatch), cell(nameOf(r)), cell(r.state), cell(r.num_seqs), cell(r.blocks.length), cell(shared));
      row.title = nameOf(r);
      return row;
    });
    $("requests").tBodies[0].replaceChildren(...rows);
  }

  // The gateway sends another tenant's request without its id: its blocks show, whose they are does not.
  function nameOf(request) {
    return request.id || "(another tenant)";
  }

  function cell(content) {
    const td = document.createElement("td");
    td.append(content instanceof Node ? content : String(content));
    return td;
  }

  function hover(id) {
    if (view.hover === id) return;
    view.hover = id;
    for (const row of $("requests").tBodies[0].rows) row.classList.toggle("hover", row.dataset.id === id);
    drawPools();
  }

  $("requests").tBodies[0].addEventListener("mouseover", (event) => {
    const row = event.target.closest("tr");
    if (row) hover(row.dataset.id);
  });
  $("requests").tBodies[0].addEventListener("mouseleave", () => hover(null));

  // ---- a cell's details under the pointer ----------------------------------------------------------------
  for (const [id, poolName] of [["device-grid", "device"], ["cpu-grid", "cpu"]]) {
    $(id).addEventListener("mousemove", (event) => showTooltip(event, id, poolName));
    $(id).addEventListener("mouseleave", () => { $("tooltip").hidden = true; });
  }

  function showTooltip(event, id, poolName) {
    const geometry = view.layouts[id], s = view.snapshot;
    if (!geometry || !s) return;
    const ratio = window.devicePixelRatio || 1;
    const column = Math.floor((event.offsetX * ratio) / geometry.cell);
    const i = Math.floor((event.offsetY * ratio) / geometry.cell) * geometry.columns + column;
    const pool = s[poolName];
    const tooltip = $("tooltip");
    if (column >= geometry.columns || i >= pool.size) {
      tooltip.hidden = true;
      return;
    }
    const owner = pool.owner[i] === NO_OWNER ? null : s.requests[pool.owner[i]];
    tooltip.textContent = [`${poolName} block ${i}: ${STATE_NAMES[pool.state[i]]}, ref count ${pool.ref[i]}`,
      `${pool.filled[i]}/${s.block_size} slots claimed, ${pool.computed[i]} written`,
      owner ? `first holder: ${nameOf(owner)} (${owner.state})` : "",
      imageBlocks(s, poolName === "cpu").has(i) ? "holds image tokens" : ""].filter(Boolean).join("\n");
    tooltip.style.left = `${event.target.offsetLeft + event.offsetX + 12}px`;
    tooltip.style.top = `${event.target.offsetTop + event.offsetY + 12}px`;
    tooltip.hidden = false;
  }

  window.addEventListener("resize", () => { drawPools(); drawChart(); });

  // For scripts and tests: the decoded snapshot on screen, the hovered request, where block i is drawn
  // (canvas pixels).
  window.kvDashboard = {
    get snapshot() { return view.snapshot; },
    get hover() { return view.hover; },
    cellBox: (gridId, i) => cellBox(view.layouts[gridId], i),
  };

  view.key = readKey();
  poll();
})();
