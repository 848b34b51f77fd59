// The viewer's state and wiring: prompt → (optional /generate) → /attention → three views,
// and a fourth, a comparison, while a LoRA adapter or a control vector is chosen: adapter
// vs base, or (with a vector) the model without vs with the vector.
// Attention comes layer by layer (layers.js): the page opens on one layer's maps, the model
// view fills in as its layers arrive, and the step view fetches one layer's q, k, v. The
// comparison keeps the adapter's maps in a second store, fetched with adapter_id, and the
// steered maps in a third, fetched with control_vector (and the adapter, if one is chosen).

import * as api from "./api.js";
import { headColour, tokenLabel } from "./colors.js";
import { CompareView } from "./compareview.js";
import { HeadView } from "./headview.js";
import { DEFAULT_BUDGET, LayerStore } from "./layers.js";
import { LensView } from "./lensview.js";
import { ModelView, legend } from "./modelview.js";
import { StepView } from "./stepview.js";

const STEP_LAYERS_KEPT = 4;  // step view: layers of every kind kept (each is q, k, v and 3 maps)

const $ = (id) => document.getElementById(id);

const state = {
  info: null,
  text: "",
  model: null,        // {L, H, T, tokens, store: LayerStore of the weights,
                      //  adapter: name or null, adapterStore: LayerStore under it or null,
                      //  vector: {name, scale} or null, vectorStore: LayerStore steered by
                      //  it (under the adapter, if any) or null}
  layers: new Map(),  // layer → npz of every kind for that layer (step view), a few kept
  budget: DEFAULT_BUDGET,  // bytes of maps per /attention request and kept (layers.js)
  layer: 0,
  heads: new Set(),
  head: 0,
  query: 0,
  view: "head",
  run: 0,             // bumps on each submit, so late answers of an old run are dropped
};

const headView = new HeadView($("head-canvas"), $("head-note"), (i) => setQuery(i));
const modelView = new ModelView($("model-grid"), {
  panel: $("model-detail"), title: $("detail-title"), canvas: $("detail-canvas"), tip: $("detail-tip"),
}, (l, h) => { state.layer = l; state.head = h; syncControls(); render(); }, (i) => setQuery(i));
const stepView = new StepView($("step"));
const compareView = new CompareView($("view-compare"));
const lensView = new LensView($("lens"), (i) => setQuery(i));
modelView.setScale($("scale").value);

function setStatus(stateName, message) {
  const status = $("status");
  status.dataset.state = stateName;
  status.textContent = message;
}

function showError(error) {
  if (error instanceof api.AuthError) {
    askForKey("The API key was refused; enter a valid one.");
    setStatus("error", "Unauthorized: the server wants a valid API key.");
  } else {
    setStatus("error", error.message || String(error));
  }
}

// --- API key ---

function askForKey(message) {
  $("auth").hidden = false;
  $("auth-message").textContent = message;
  $("api-key").focus();
}

$("auth-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  api.setApiKey($("api-key").value.trim());
  $("api-key").value = "";
  await connect();
});

async function connect() {
  if (api.authRequired() && !api.apiKey()) {
    askForKey("Kept in this tab only (sessionStorage).");
    $("model-info").textContent = "API key required";
    return;
  }
  try {
    state.info = await api.getInfo();
  } catch (error) {
    showError(error);
    return;
  }
  $("auth").hidden = true;
  const c = state.info.model_config;
  $("model-info").textContent = `${state.info.model} · ${c.n_layers} layers × ${c.n_heads} heads`
    + ` · d_model ${c.d_model} · context ${c.max_seq_len} · ${state.info.provider}`;
  $("max-new").max = state.info.limits.max_new_tokens;
  await listAdapters();
  listVectors();
  setStatus("idle", "Enter a prompt.");
  $("run").disabled = false;
}

/** The adapter picker: shown when GET /v1/models lists adapters (cards with a parent). */
async function listAdapters() {
  let names = [];
  try {
    names = await api.adapterNames();
  } catch {
    names = [];  // no comparison offered; the rest of the page works as before
  }
  const select = $("adapter");
  const chosen = select.value;
  select.replaceChildren(select.options[0], ...names.map((name) => Object.assign(
    document.createElement("option"), { value: name, textContent: name })));
  select.value = names.includes(chosen) ? chosen : "";
  $("adapter-pick").hidden = names.length === 0;
}

/** The control-vector picker: shown when GET /info lists control vectors; the scale is
 *  bounded by the server's --max-control-scale. */
function listVectors() {
  const names = state.info.control_vectors || [];
  const select = $("vector");
  const chosen = select.value;
  select.replaceChildren(select.options[0], ...names.map((name) => Object.assign(
    document.createElement("option"), { value: name, textContent: name })));
  select.value = names.includes(chosen) ? chosen : "";
  const limit = state.info.max_control_scale;
  Object.assign($("vector-scale"), { min: -limit, max: limit });
  $("vector-pick").hidden = names.length === 0;
}

/** The chosen control vector, {name, scale}, or null. */
function chosenVector() {
  const name = $("vector").value;
  if (!name) return null;
  const typed = $("vector-scale").value.trim();
  const scale = typed === "" ? NaN : Number(typed);  // Number("") would be 0
  return { name, scale: Number.isFinite(scale) ? scale : 1 };
}

for (const id of ["adapter", "vector", "vector-scale"]) {
  $(id).addEventListener("change", () => {
    if (!state.model) return;  // applies to the next input
    useVariant(state.model);
    syncControls();
    render();
  });
}

/** Compare ``model``'s input under the chosen adapter with the base, or, with a control
 *  vector chosen, without and with the vector (under the adapter, if one is chosen); the
 *  comparison opens when either is chosen and closes with them. */
function useVariant(model) {
  const adapter = $("adapter").value || null;
  if (adapter !== model.adapter || !model.adapterStore) {
    model.adapterStore = adapter ? new LayerStore(
      (layers) => api.attention(model.text, { layers, adapter }), model, state.budget) : null;
  }
  model.adapter = adapter;
  const vector = chosenVector();
  const same = vector && model.vector && vector.name === model.vector.name
    && vector.scale === model.vector.scale && model.vectorAdapter === adapter;
  if (!same) {
    model.vectorStore = vector ? new LayerStore(
      (layers) => api.attention(model.text, { layers, adapter, vector }), model,
      state.budget) : null;
  }
  Object.assign(model, { vector, vectorAdapter: adapter });
  if (adapter || vector) state.view = "compare";
  else if (state.view === "compare") state.view = "head";
}

// --- running a prompt ---

$("prompt-form").addEventListener("submit", (e) => {
  e.preventDefault();
  submit();
});

async function submit() {
  const prompt = $("prompt").value;
  if (!prompt) { setStatus("error", "The prompt is empty."); return; }
  const run = ++state.run;
  $("run").disabled = true;
  try {
    let text = prompt;
    $("continuation").hidden = true;
    if ($("continue").checked) {
      setStatus("busy", "Generating a continuation…");
      const maxNew = Number($("max-new").value) || 16;
      const generated = await api.generate(prompt, maxNew);
      if (run !== state.run) return;
      text = prompt + generated.generated_text;
      const box = $("continuation");
      box.replaceChildren(document.createTextNode(prompt),
        Object.assign(document.createElement("mark"), {
          textContent: generated.generated_text.replace(/\n/g, "↵\n"),
          title: "generated by /generate (greedy)",
        }));
      box.hidden = false;
    }
    setStatus("busy", "Computing attention…");
    const started = performance.now();
    const layer = Math.min(state.layer, state.info.model_config.n_layers - 1);
    const npz = await api.attention(text, { layers: [layer] });
    if (run !== state.run) return;
    load(text, prompt.length, npz, layer);
    await render();
    const ms = Math.round(performance.now() - started);
    const { L, H, T } = state.model;
    setStatus("ready", `${T} tokens · ${L} × ${H} maps · layer ${layer} in ${ms} ms`);
  } catch (error) {
    if (run === state.run) showError(error);
  } finally {
    if (run === state.run) $("run").disabled = false;
  }
}

function load(text, promptChars, npz, layer) {
  const [, H, T] = npz.weights.shape;
  const L = state.info.model_config.n_layers;
  let offset = 0;
  const tokens = npz.tokens.data.map((t) => {
    const token = { text: t, generated: offset >= promptChars };
    offset += t.length;
    return token;
  });
  state.text = text;
  const store = new LayerStore((layers) => api.attention(text, { layers }), { L, H, T },
    state.budget);
  store.add(npz);
  state.model = { L, H, T, tokens, store, text };
  useVariant(state.model);
  state.layers = new Map();
  state.layer = layer;
  state.head = Math.min(state.head, H - 1);
  state.heads = new Set([...state.heads].filter((h) => h < H));
  if (state.heads.size === 0) state.heads = new Set(Array.from({ length: H }, (_, h) => h));
  state.query = T - 1;
  headView.setData(state.model);
  modelView.setData(state.model);
  buildControls();
  $("views").hidden = false;
}

// --- controls ---

function options(select, labels) {
  select.replaceChildren(...labels.map((label, i) => Object.assign(document.createElement("option"),
    { value: i, textContent: label })));
}

function buildControls() {
  const { L, H, tokens } = state.model;
  options($("layer"), Array.from({ length: L }, (_, l) => `${l}`));
  options($("head"), Array.from({ length: H }, (_, h) => `${h}`));
  options($("query"), tokens.map((t, i) => `${i}: ${tokenLabel(t.text, 16)}`));
  const heads = $("heads");
  heads.replaceChildren();
  for (let h = 0; h < H; h++) {
    const chip = document.createElement("button");
    chip.type = "button";
    chip.className = "chip";
    chip.dataset.head = h;
    chip.textContent = h;
    chip.title = `head ${h}: click to toggle, double-click to show only this head`;
    chip.style.setProperty("--head", headColour(h));
    chip.addEventListener("click", () => {
      if (state.heads.has(h)) state.heads.delete(h); else state.heads.add(h);
      syncControls();
      render();
    });
    chip.addEventListener("dblclick", () => { state.heads = new Set([h]); syncControls(); render(); });
    heads.append(chip);
  }
  syncControls();
}

function syncControls() {
  $("layer").value = state.layer;
  $("head").value = state.head;
  $("query").value = state.query;
  for (const chip of $("heads").children) {
    chip.setAttribute("aria-pressed", state.heads.has(Number(chip.dataset.head)));
  }
  for (const tab of document.querySelectorAll(".tabs [data-view]")) {
    tab.setAttribute("aria-selected", tab.dataset.view === state.view);
  }
  const compareTab = document.querySelector(".tabs [data-view=compare]");
  compareTab.hidden = !state.model?.adapter && !state.model?.vector;
  compareTab.textContent = state.model?.vector ? "With vs without vector" : "Adapter vs base";
  for (const view of document.querySelectorAll(".view")) view.hidden = view.dataset.view !== state.view;
  $("views").dataset.view = state.view;
}

$("layer").addEventListener("change", (e) => { state.layer = Number(e.target.value); render(); });
$("head").addEventListener("change", (e) => { state.head = Number(e.target.value); render(); });
$("query").addEventListener("change", (e) => setQuery(Number(e.target.value)));
$("heads-all").addEventListener("click", () => {
  state.heads = new Set(Array.from({ length: state.model.H }, (_, h) => h));
  syncControls();
  render();
});
$("heads-none").addEventListener("click", () => { state.heads = new Set(); syncControls(); render(); });
for (const tab of document.querySelectorAll(".tabs [data-view]")) {
  tab.addEventListener("click", () => { state.view = tab.dataset.view; syncControls(); render(); });
}
$("detail-step").addEventListener("click", () => { state.view = "step"; syncControls(); render(); });
document.addEventListener("keydown", (e) => {
  if (!state.model || e.target.closest("input, textarea, select")) return;
  if (e.key === "ArrowLeft" && state.query > 0) setQuery(state.query - 1);
  if (e.key === "ArrowRight" && state.query < state.model.T - 1) setQuery(state.query + 1);
});

function setQuery(i) {
  state.query = i;
  syncControls();
  render();
}

// --- rendering ---

async function render() {
  if (!state.model) return;
  const { view, model } = state;
  if (view === "head") await renderHead();
  else if (view === "model") await renderModel();
  else if (view === "compare") await renderCompare();
  else if (view === "lens") await renderLens();
  else await renderStep();
  if (model === state.model && view === state.view) $("views").dataset.rendered = view;
}

/** The current layer's weights, fetched when not held; undefined if the input changed. */
async function layerMaps(layer) {
  const { model } = state;
  let maps = model.store.get(layer);
  if (maps === undefined) {
    setStatus("busy", `Fetching the maps of layer ${layer}…`);
    try {
      maps = await model.store.need(layer);
    } catch (error) {
      if (model === state.model) showError(error);
      return undefined;
    }
    if (model !== state.model) return undefined;
    setStatus("ready", `${model.T} tokens · ${model.L} × ${model.H} maps · layer ${layer} loaded`);
  }
  return maps;
}

async function renderHead() {
  const { layer } = state;
  const maps = await layerMaps(layer);
  if (maps === undefined || state.view !== "head" || state.layer !== layer) return;
  headView.show(layer, maps, state.heads, state.query);
}

async function renderModel() {
  const { layer, head, query, model } = state;
  modelView.open(layer, head, query, model.store.get(layer));
  fillModelView(model);
  if (!model.store.has(layer)) {
    const maps = await layerMaps(layer);
    if (maps === undefined || state.view !== "model" || state.layer !== layer) return;
    modelView.open(state.layer, state.head, state.query, maps);
  }
}

/** Every layer's thumbnails, one request of a few layers at a time (once per input). */
async function fillModelView(model) {
  if (model.filling) return;
  model.filling = true;
  const alive = () => model === state.model;
  try {
    await model.store.each((l, maps) => {
      modelView.addLayer(l, maps);
      if (modelView.pools.size < model.L) {
        setStatus("busy", `Model view: ${modelView.pools.size} of ${model.L} layers…`);
      }
    }, alive);
  } catch (error) {
    model.filling = false;
    if (alive()) showError(error);
    return;
  }
  if (alive()) setStatus("ready", `${model.T} tokens · ${model.L} × ${model.H} maps · all layers`);
}

/** The panels of the comparison: [without, with] stores (null: the base's, layerMaps),
 *  their captions and the hint. */
function comparison(model) {
  if (!model.vector) {
    return { stores: [null, model.adapterStore], titles: {
      base: "base", adapter: `adapter ${model.adapter}`, diff: "Δα = adapter − base",
    }, hint: "One head's attention under the base model, under the adapter, and what the "
      + "fine-tune changed: Δα = adapter − base, blue where the adapter attends less, red "
      + "where more, scaled to this head's largest change. Hover or click a cell to read it out." };
  }
  const without = model.adapter ? `adapter ${model.adapter}` : "base";
  const { name, scale } = model.vector;
  return { stores: [model.adapterStore, model.vectorStore], titles: {
    base: `${without}, no vector`, adapter: `${without}, vector ${name} × ${scale}`,
    diff: "Δα = with − without vector",
  }, hint: `One head's attention without and with control vector ${name} at scale ${scale} `
    + `(${without}), and what the vector changed: Δα = with − without, blue where the `
    + "steered model attends less, red where more, scaled to this head's largest change. A "
    + "vector is added after each layer from layer 1 on, so layers 0 and 1 never change. "
    + "Hover or click a cell to read it out." };
}

/** ``store``'s maps of ``layer`` (null: the base's), fetched when not held; undefined when
 *  the fetch failed or the comparison changed meanwhile. */
async function variantMaps(model, store, layer) {
  if (store === null) return layerMaps(layer);
  let maps = store.get(layer);
  if (maps === undefined) {
    setStatus("busy", `Fetching layer ${layer} for the comparison…`);
    try {
      maps = await store.need(layer);
    } catch (error) {
      if (model === state.model) showError(error);
      return undefined;
    }
    setStatus("ready", `${model.T} tokens · layer ${layer} for the comparison loaded`);
  }
  return maps;
}

/** Without, with and their difference for the current (layer, head). */
async function renderCompare() {
  const { layer, model } = state;
  const { stores, titles, hint } = comparison(model);
  delete $("compare").dataset.ready;
  const base = await variantMaps(model, stores[0], layer);
  if (base === undefined) return;
  const tuned = await variantMaps(model, stores[1], layer);
  if (tuned === undefined) return;
  const now = comparison(state.model).stores;
  if (model !== state.model || now[0] !== stores[0] || now[1] !== stores[1]
      || state.view !== "compare" || state.layer !== layer) return;
  $("compare-hint").textContent = hint;
  $("compare").dataset.variant = model.vector ? "vector" : "adapter";
  compareView.show(model, titles, layer, state.head, base, tuned);
}

/** The logit lens of every layer and the attribution at the query, one request each query
 *  and control vector (the chosen one, if any: both are computed under it). */
async function renderLens() {
  const { model, query } = state;
  const vector = model.vector;
  const key = lensKey(query, vector);
  model.lens = model.lens || new Map();
  let data = model.lens.get(key);
  if (data === undefined) {
    setStatus("busy", "Computing the logit lens and head attribution…");
    try {
      data = await api.lookInside(model.text, query, { vector });
    } catch (error) {
      if (model === state.model) showError(error);
      return;
    }
    model.lens.set(key, data);
    setStatus("ready", `${model.T} tokens · logit lens of ${model.L} layers`);
  }
  if (model === state.model && state.view === "lens"
      && lensKey(state.query, model.vector) === key) {
    lensView.show(data, model.tokens, query);
  }
}

function lensKey(query, vector) {
  return vector ? `${query} ${vector.name} ${vector.scale}` : `${query}`;
}

async function renderStep() {
  const { layer, run } = state;
  let data = state.layers.get(layer);
  if (!data) {
    const step = $("step");
    step.dataset.loading = "true";
    setStatus("busy", `Fetching q, k, v and scores of layer ${layer}…`);
    try {
      data = await api.attention(state.text, {
        layers: [layer], include: ["q", "k", "v", "scores", "scaled_scores", "weights"],
      });
    } catch (error) {
      showError(error);
      return;
    } finally {
      delete step.dataset.loading;
    }
    if (run !== state.run) return;
    state.layers.set(layer, data);
    while (state.layers.size > STEP_LAYERS_KEPT) state.layers.delete(state.layers.keys().next().value);
    const { L, H, T } = state.model;
    setStatus("ready", `${T} tokens · ${L} × ${H} maps · layer ${layer} loaded`);
  }
  if (state.view === "step" && state.layer === layer) {
    stepView.render(data, state.model.tokens, layer, state.head, state.query);
  }
}

// --- theme ---

function applyTheme(theme) {
  document.documentElement.dataset.theme = theme;
  sessionStorage.setItem("attnserve.theme", theme);
}

$("theme").addEventListener("click", () => {
  applyTheme(document.documentElement.dataset.theme === "dark" ? "light" : "dark");
  if (state.model) {
    modelView.drawn = false;
    headView.cache = null;
    render();
  }
});

applyTheme(sessionStorage.getItem("attnserve.theme")
  || (window.matchMedia("(prefers-color-scheme: dark)").matches ? "dark" : "light"));
legend($("model-legend"), $("scale").value);
$("scale").addEventListener("change", (e) => {
  modelView.setScale(e.target.value);
  legend($("model-legend"), e.target.value);
  render();
});
$("run").disabled = true;
window.attnviz = { state, render, submit };  // for tests and the console
connect();
