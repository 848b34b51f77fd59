// Model view: one small attention map per layer × head (a canvas each, max-pooled down to
// the thumbnail so a sharp diagonal stays visible at any length), and one opened map with
// hover read-out and row picking. Layers arrive one request at a time (layers.js): each
// row of thumbnails is painted when its layer comes, and only the pooled cells are kept.

import { VIRIDIS, cssVar, fmt, sizeCanvas, tokenLabel, viridisCss } from "./colors.js";

const LABELLED = 48;  // token labels on the opened map up to this many tokens

/** Colour scales: α itself, or √α, which lifts the faint weights of long inputs. */
export const SCALES = { linear: (a) => a, sqrt: (a) => Math.sqrt(a) };

/** Head h of one layer's maps (H, T, T), max-pooled to s × s cells. */
function poolCells(maps, h, T, s) {
  const cell = new Float32Array(s * s);
  const base = h * T * T;
  for (let i = 0; i < T; i++) {
    const pi = Math.floor((i * s) / T) * s;
    const row = base + i * T;
    for (let j = 0; j < T; j++) {
      const p = pi + Math.floor((j * s) / T);
      const a = maps[row + j];
      if (a > cell[p]) cell[p] = a;
    }
  }
  return cell;
}

/** Pooled cells (s × s) → ImageData in viridis under ``scale`` (monotone: max commutes). */
function paint(cell, s, scale) {
  const image = new ImageData(s, s);
  for (let p = 0; p < s * s; p++) {
    const c = Math.max(0, Math.min(255, Math.round(scale(cell[p]) * 255))) * 3;
    image.data[p * 4] = VIRIDIS[c];
    image.data[p * 4 + 1] = VIRIDIS[c + 1];
    image.data[p * 4 + 2] = VIRIDIS[c + 2];
    image.data[p * 4 + 3] = 255;
  }
  return image;
}

export class ModelView {
  constructor(grid, detail, onOpen, onPick) {
    this.grid = grid;
    this.detail = detail;  // {panel, title, canvas, tip}
    this.onOpen = onOpen;
    this.onPick = onPick;
    detail.canvas.addEventListener("mousemove", (e) => this.hover(e));
    detail.canvas.addEventListener("mouseleave", () => { this.detail.tip.textContent = "Hover the map for α; click a row to pick the query."; });
    detail.canvas.addEventListener("click", (e) => {
      const cell = this.cellAt(e);
      if (cell) this.onPick(cell.i);
    });
  }

  /** model: {L, H, T, tokens}; the layers' maps come through ``addLayer``. */
  setData(model) {
    this.model = model;
    this.pools = new Map();  // layer → [pooled cells per head]
    this.side = undefined;
    this.maps = undefined;
    this.drawn = false;
  }

  setScale(name) {
    this.scale = SCALES[name];
    this.drawn = false;
  }

  /** Build the grid (once per data set, when the view is first shown); paint what is held. */
  drawGrid() {
    if (this.drawn) return;
    const { L, H, T } = this.model;
    // Leave room beside the grid for the opened map (the layout wraps below 900 px).
    const total = this.grid.closest(".model-layout").clientWidth || 900;
    const width = total >= 900 ? total - 480 : total;
    const thumb = Math.max(24, Math.min(96, Math.floor((width - 40) / H) - 6));
    this.grid.style.setProperty("--cols", H);
    this.grid.style.setProperty("--thumb", `${thumb}px`);
    this.grid.replaceChildren();
    this.grid.append(document.createElement("span"));
    for (let h = 0; h < H; h++) {
      const label = document.createElement("span");
      label.className = "axis";
      label.textContent = `h${h}`;
      this.grid.append(label);
    }
    // Fixed per data set: the pooled cells kept for each layer are of this side.
    if (this.side === undefined) this.side = Math.min(T, Math.round(thumb * (window.devicePixelRatio || 1)));
    this.cells = [];
    for (let l = 0; l < L; l++) {
      const label = document.createElement("span");
      label.className = "axis";
      label.textContent = `L${l}`;
      this.grid.append(label);
      for (let h = 0; h < H; h++) {
        const canvas = document.createElement("canvas");
        canvas.width = this.side;
        canvas.height = this.side;
        canvas.className = "thumb";
        canvas.dataset.layer = l;
        canvas.dataset.head = h;
        canvas.title = `layer ${l}, head ${h}`;
        canvas.addEventListener("click", () => this.onOpen(l, h));
        this.grid.append(canvas);
        this.cells.push(canvas);
      }
    }
    this.drawn = true;
    for (const l of this.pools.keys()) this.paintLayer(l);
    this.grid.dataset.loaded = this.pools.size;
  }

  /** A layer's maps (H, T, T) arrived: pool and paint its row of thumbnails. */
  addLayer(layer, maps) {
    if (!this.drawn) this.drawGrid();
    if (!this.pools.has(layer)) {
      const { H, T } = this.model;
      this.pools.set(layer, Array.from({ length: H }, (_, h) => poolCells(maps, h, T, this.side)));
    }
    this.paintLayer(layer);
    this.grid.dataset.loaded = this.pools.size;
  }

  paintLayer(layer) {
    const { H } = this.model;
    const pools = this.pools.get(layer);
    for (let h = 0; h < H; h++) {
      const canvas = this.cells[layer * H + h];
      canvas.getContext("2d").putImageData(paint(pools[h], this.side, this.scale), 0, 0);
      canvas.dataset.ready = "true";
    }
  }

  /** Outline the current (layer, head) and paint it large with the query row marked;
   *  ``maps``: that layer's (H, T, T), or undefined while it is being fetched. */
  open(layer, head, query, maps) {
    this.drawGrid();
    for (const c of this.cells) {
      c.classList.toggle("selected", Number(c.dataset.layer) === layer && Number(c.dataset.head) === head);
    }
    Object.assign(this, { layer, head, query, maps });
    const { T, tokens } = this.model;
    this.detail.panel.hidden = false;
    this.detail.title.textContent = `layer ${layer} · head ${head}`;
    this.detail.canvas.dataset.layer = layer;
    this.detail.canvas.dataset.head = head;
    if (maps === undefined) {
      delete this.detail.canvas.dataset.ready;
      return;
    }
    const labelled = T <= LABELLED;
    this.margin = labelled ? 96 : 8;
    const avail = Math.max(240, Math.min(560, (this.detail.panel.clientWidth || 560) - this.margin - 8));
    this.cell = Math.max(1, Math.floor(avail / T));
    const side = this.cell * T;
    const size = this.margin + side + 4;
    const ctx = sizeCanvas(this.detail.canvas, size, size);
    const off = document.createElement("canvas");
    off.width = T;
    off.height = T;
    off.getContext("2d").putImageData(paint(poolCells(maps, head, T, T), T, this.scale), 0, 0);
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(off, this.margin, this.margin, side, side);
    if (query !== null && query < T) {
      ctx.strokeStyle = cssVar("--accent");
      ctx.lineWidth = 2;
      ctx.strokeRect(this.margin - 1, this.margin + query * this.cell - 1, side + 2, this.cell + 2);
    }
    if (labelled) {
      ctx.font = "11px ui-monospace, monospace";
      ctx.textBaseline = "middle";
      for (let i = 0; i < T; i++) {
        ctx.fillStyle = tokens[i].generated ? cssVar("--generated") : cssVar("--fg");
        const label = tokenLabel(tokens[i].text, 12);
        ctx.textAlign = "right";
        ctx.fillText(label, this.margin - 4, this.margin + (i + 0.5) * this.cell);
        ctx.save();
        ctx.translate(this.margin + (i + 0.5) * this.cell, this.margin - 4);
        ctx.rotate(-Math.PI / 2);
        ctx.textAlign = "left";
        ctx.fillText(label, 0, 0);
        ctx.restore();
      }
    }
    this.detail.canvas.dataset.ready = "true";
  }

  cellAt(e) {
    if (!this.model || this.layer === undefined || this.maps === undefined) return null;
    const rect = this.detail.canvas.getBoundingClientRect();
    const i = Math.floor((e.clientY - rect.top - this.margin) / this.cell);
    const j = Math.floor((e.clientX - rect.left - this.margin) / this.cell);
    const { T } = this.model;
    return i >= 0 && j >= 0 && i < T && j < T ? { i, j } : null;
  }

  hover(e) {
    const cell = this.cellAt(e);
    if (!cell) return;
    const { T, tokens } = this.model;
    const a = this.maps[(this.head * T + cell.i) * T + cell.j];
    this.detail.tip.textContent = `query ${cell.i} “${tokenLabel(tokens[cell.i].text)}” → key ${cell.j} “${tokenLabel(tokens[cell.j].text)}”: α = ${fmt(a, 4)}`;
  }
}

/** A colour bar 0 … 1 for α, with the α at its middle under the chosen scale. */
export function legend(container, scaleName) {
  container.replaceChildren();
  const title = document.createElement("span");
  title.textContent = scaleName === "sqrt" ? "α (colour ∝ √α; middle = 0.25)" : "α (middle = 0.5)";
  const bar = document.createElement("canvas");
  bar.className = "legend-bar";
  bar.width = 256;
  bar.height = 1;
  const ctx = bar.getContext("2d");
  for (let x = 0; x < 256; x++) {
    ctx.fillStyle = viridisCss(x / 255);
    ctx.fillRect(x, 0, 1, 1);
  }
  const low = document.createElement("span");
  low.textContent = "0";
  const high = document.createElement("span");
  high.textContent = "1";
  container.append(title, low, bar, high);
}
