// Two variants of the model side by side: one head's attention map without and with a
// change, and their difference (with − without), for one input: the base model and a LoRA
// adapter, or the model (base or adapter) without and with a control vector. α maps use
// viridis as the other views do; the difference a diverging blue–neutral–red scale centred
// on 0 and stretched to this head's largest |Δα|, the range printed under it. One cell is
// read out (hover or click one; at first, the cell that changed most), its numbers at full
// precision in data attributes.

import { VIRIDIS, divergingRgb, fmt, isDark, sizeCanvas, tokenLabel } from "./colors.js";

const LABELLED = 32;  // token labels beside the maps up to this many tokens
const SIDE = 300;     // CSS px of each map, at most

/** Head h of (H, T, T) maps as T × T ImageData, each cell through ``rgb(value)``. */
function image(values, T, rgb) {
  const out = new ImageData(T, T);
  for (let p = 0; p < T * T; p++) {
    const [r, g, b] = rgb(values[p]);
    out.data.set([r, g, b, 255], p * 4);
  }
  return out;
}

const alphaRgb = (a) => {
  const c = Math.max(0, Math.min(255, Math.round(a * 255))) * 3;
  return [VIRIDIS[c], VIRIDIS[c + 1], VIRIDIS[c + 2]];
};

export class CompareView {
  /** root: the view's element; it holds #compare (the panels) and #compare-cell. */
  constructor(root) {
    this.root = root;
    this.panels = root.querySelector("#compare");
    this.readout = root.querySelector("#compare-cell");
    this.canvases = ["base", "adapter", "diff"].map((kind) => {
      const canvas = this.panels.querySelector(`canvas[data-kind='${kind}']`);
      canvas.addEventListener("mousemove", (e) => this.pick(e));
      canvas.addEventListener("click", (e) => this.pick(e));
      return canvas;
    });
  }

  /** model: {T, tokens}; titles: {base, adapter, diff}, the panels' captions (the
   *  "adapter" panel holds the changed variant); base, tuned: that layer's (H, T, T) maps. */
  show(model, titles, layer, head, base, tuned) {
    const { T, tokens } = model;
    const offset = head * T * T;
    this.base = base.subarray(offset, offset + T * T);
    this.tuned = tuned.subarray(offset, offset + T * T);
    this.diff = new Float64Array(T * T);  // exact: a float32 minus a float32, as a double
    let range = 0;
    let most = 0;
    for (let p = 0; p < T * T; p++) {
      this.diff[p] = this.tuned[p] - this.base[p];
      if (Math.abs(this.diff[p]) > range) { range = Math.abs(this.diff[p]); most = p; }
    }
    Object.assign(this, { model, titles, layer, head, range });
    for (const [kind, title] of Object.entries(titles)) {
      this.panels.querySelector(`.compare-title[data-kind='${kind}']`).textContent = title;
    }
    const dark = isDark();
    const scaled = (d) => divergingRgb(range > 0 ? d / range : 0, dark);
    this.cell = Math.max(1, Math.floor(SIDE / T));
    this.margin = T <= LABELLED ? 72 : 4;
    const pictures = [image(this.base, T, alphaRgb), image(this.tuned, T, alphaRgb),
      image(this.diff, T, scaled)];
    this.canvases.forEach((canvas, k) => this.paint(canvas, pictures[k], tokens));
    const legend = this.panels.querySelector("#compare-range");
    legend.dataset.range = range;
    legend.querySelector(".low").textContent = fmt(-range, 4);
    legend.querySelector(".high").textContent = `+${fmt(range, 4)}`;
    const bar = legend.querySelector("canvas");
    const ctx = bar.getContext("2d");
    for (let x = 0; x < bar.width; x++) {
      ctx.fillStyle = `rgb(${divergingRgb((2 * x) / (bar.width - 1) - 1, dark).join(", ")})`;
      ctx.fillRect(x, 0, 1, bar.height);
    }
    this.select(Math.floor(most / T), most % T);
    Object.assign(this.panels.dataset, {
      layer, head, cell: this.cell, margin: this.margin, ready: "true",
    });
  }

  paint(canvas, picture, tokens) {
    const { T } = this.model;
    const side = this.cell * T;
    const ctx = sizeCanvas(canvas, this.margin + side + 2, this.margin + side + 2);
    const off = document.createElement("canvas");
    off.width = T;
    off.height = T;
    off.getContext("2d").putImageData(picture, 0, 0);
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(off, this.margin, this.margin, side, side);
    if (T > LABELLED) return;
    ctx.font = "10px ui-monospace, monospace";
    ctx.textBaseline = "middle";
    ctx.fillStyle = getComputedStyle(canvas).color;
    for (let i = 0; i < T; i++) {
      const label = tokenLabel(tokens[i].text, 9);
      ctx.textAlign = "right";
      ctx.fillText(label, this.margin - 3, this.margin + (i + 0.5) * this.cell);
      ctx.save();
      ctx.translate(this.margin + (i + 0.5) * this.cell, this.margin - 3);
      ctx.rotate(-Math.PI / 2);
      ctx.textAlign = "left";
      ctx.fillText(label, 0, 0);
      ctx.restore();
    }
  }

  pick(e) {
    if (!this.model) return;
    const rect = e.currentTarget.getBoundingClientRect();
    const i = Math.floor((e.clientY - rect.top - this.margin) / this.cell);
    const j = Math.floor((e.clientX - rect.left - this.margin) / this.cell);
    const { T } = this.model;
    if (i >= 0 && j >= 0 && i < T && j < T) this.select(i, j);
  }

  /** Read out cell (query i, key j) of the three maps. */
  select(i, j) {
    const { T, tokens } = this.model;
    const p = i * T + j;
    Object.assign(this.readout.dataset, {
      i, j, base: this.base[p], adapter: this.tuned[p], diff: this.diff[p],
    });
    const masked = j > i ? " (masked: a later key)" : "";
    this.readout.textContent = `query ${i} “${tokenLabel(tokens[i].text)}” → key ${j} `
      + `“${tokenLabel(tokens[j].text)}”${masked}: ${this.titles.base} α = ${fmt(this.base[p], 5)}, `
      + `${this.titles.adapter} α = ${fmt(this.tuned[p], 5)}, Δα = ${fmt(this.diff[p], 5)}`;
  }
}
