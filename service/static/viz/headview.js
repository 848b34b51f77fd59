// Head view: query tokens on the left, key tokens on the right, a line from i to j for each
// selected head with opacity α[i][j]. Drawn on one canvas; the unfocused picture is drawn
// once per (layer, heads) into an offscreen canvas and reused while the mouse moves.

import { cssVar, fmt, headColour, sizeCanvas, tokenLabel } from "./colors.js";

const ROW = 20;          // CSS px per token row
const TOP = 28;          // room for the column titles
const GAP_MIN = 180;     // width of the band the lines cross
const LEVELS = 16;       // opacity buckets for the unfocused picture (one stroke per bucket)
const FLOOR = 1 / 128;   // lines fainter than this are left out of the unfocused picture
const BUDGET = 12000;    // at most this many lines in the unfocused picture (the strongest)
const FONT = "13px ui-monospace, SFMono-Regular, Menlo, Consolas, monospace";

export class HeadView {
  constructor(canvas, note, onPick) {
    this.canvas = canvas;
    this.note = note;
    this.onPick = onPick;
    this.model = null;
    this.focus = null;  // {side: "left" | "right", index}
    this.cache = null;  // {key, canvas}
    canvas.addEventListener("mousemove", (e) => this.hover(e));
    canvas.addEventListener("mouseleave", () => this.setFocus(null));
    canvas.addEventListener("click", (e) => {
      const hit = this.hit(e);
      if (hit && hit.side === "left") this.onPick(hit.index);
    });
  }

  /** model: {L, H, T, tokens: [{text, generated}]}; the maps come with ``show``. */
  setData(model) {
    this.model = model;
    this.maps = null;
    this.cache = null;
    this.focus = null;
    const ctx = this.canvas.getContext("2d");
    ctx.font = FONT;
    const widest = Math.max(...model.tokens.map((t) => ctx.measureText(tokenLabel(t.text, 18)).width));
    this.labelW = Math.ceil(Math.min(170, widest + 16));
  }

  /** maps: the layer's weights, Float32Array (H, T, T). */
  show(layer, maps, heads, query) {
    if (maps !== this.maps) this.cache = null;
    this.layer = layer;
    this.maps = maps;
    this.heads = heads;
    this.query = query;
    const { T } = this.model;
    const parent = this.canvas.parentElement.clientWidth || 640;
    this.width = Math.max(2 * this.labelW + GAP_MIN + 48, Math.min(parent - 4, 2 * this.labelW + 560));
    this.height = TOP + T * ROW + 8;
    this.draw();
    this.canvas.dataset.layer = layer;
  }

  hit(e) {
    const rect = this.canvas.getBoundingClientRect();
    const x = e.clientX - rect.left;
    const y = e.clientY - rect.top;
    const index = Math.floor((y - TOP) / ROW);
    if (index < 0 || index >= this.model.T) return null;
    if (x <= this.labelW + 4) return { side: "left", index };
    if (x >= this.rightX() - 4 && x <= this.rightX() + this.labelW) return { side: "right", index };
    return null;
  }

  hover(e) {
    this.setFocus(this.hit(e));
  }

  setFocus(focus) {
    if (!this.maps) return;
    const same = (focus === null && this.focus === null) || (focus && this.focus
      && focus.side === this.focus.side && focus.index === this.focus.index);
    if (same) return;
    this.focus = focus;
    this.canvas.style.cursor = focus && focus.side === "left" ? "pointer" : "default";
    this.draw();
  }

  rightX() { return this.width - this.labelW - 48; }

  y(i) { return TOP + i * ROW + ROW / 2; }

  alpha(h, i, j) {
    const { T } = this.model;
    return this.maps[(h * T + i) * T + j];
  }

  draw() {
    const ctx = sizeCanvas(this.canvas, this.width, this.height);
    ctx.clearRect(0, 0, this.width, this.height);
    if (this.focus === null) {
      ctx.drawImage(this.allLines(), 0, 0, this.width, this.height);
    } else {
      this.focusLines(ctx);
    }
    this.labels(ctx);
  }

  /** Every selected head's lines at once, bucketed by opacity; cached per (layer, heads). */
  allLines() {
    const key = `${this.layer}|${[...this.heads].join(",")}|${this.width}`;
    if (this.cache && this.cache.key === key) return this.cache.canvas;
    const off = document.createElement("canvas");
    const ctx = sizeCanvas(off, this.width, this.height);
    const { T } = this.model;
    const x0 = this.labelW + 6;
    const x1 = this.rightX() - 6;
    const floor = this.floor();
    ctx.lineWidth = 1.6;
    for (const h of this.heads) {
      const paths = Array.from({ length: LEVELS }, () => new Path2D());
      for (let i = 0; i < T; i++) {
        for (let j = 0; j <= i; j++) {  // causal: α is 0 past the query
          const a = this.alpha(h, i, j);
          if (a < floor) continue;
          const path = paths[Math.min(LEVELS - 1, Math.floor(a * LEVELS))];
          path.moveTo(x0, this.y(i));
          path.lineTo(x1, this.y(j));
        }
      }
      ctx.strokeStyle = headColour(h);
      paths.forEach((path, level) => {
        ctx.globalAlpha = (level + 0.5) / LEVELS;
        ctx.stroke(path);
      });
    }
    ctx.globalAlpha = 1;
    this.cache = { key, canvas: off };
    this.note.textContent = this.dropped
      ? `Drawing the ${BUDGET.toLocaleString("en")} strongest lines (α ≥ ${fmt(floor, 3)}); `
        + `${this.dropped.toLocaleString("en")} fainter ones are left out. Hover a token to see all of its lines.`
      : "";
    return off;
  }

  /** The faintest α drawn unfocused: FLOOR, raised so at most BUDGET lines are drawn
   *  (a software-rastered canvas takes seconds for 10⁵ long lines, and they are a blur). */
  floor() {
    const { T } = this.model;
    const bins = new Uint32Array(1024);  // histogram of α ≥ FLOOR over the selected heads
    let count = 0;
    for (const h of this.heads) {
      for (let i = 0; i < T; i++) {
        for (let j = 0; j <= i; j++) {
          const a = this.alpha(h, i, j);
          if (a >= FLOOR) { bins[Math.min(1023, Math.floor(a * 1024))]++; count++; }
        }
      }
    }
    this.dropped = 0;
    if (count <= BUDGET) return FLOOR;
    let kept = 0;
    for (let b = 1023; b >= 0; b--) {
      if (kept + bins[b] > BUDGET) {
        this.dropped = count - kept;
        return (b + 1) / 1024;
      }
      kept += bins[b];
    }
    return FLOOR;
  }

  focusLines(ctx) {
    const { T } = this.model;
    const { side, index } = this.focus;
    const x0 = this.labelW + 6;
    const x1 = this.rightX() - 6;
    const heads = [...this.heads];
    heads.forEach((h, n) => {
      ctx.strokeStyle = headColour(h);
      ctx.fillStyle = headColour(h);
      for (let other = 0; other < T; other++) {
        const [i, j] = side === "left" ? [index, other] : [other, index];
        const a = this.alpha(h, i, j);
        if (a <= 0) continue;
        ctx.globalAlpha = 0.12 + 0.88 * a;  // monotone in α, and a weak link stays visible
        ctx.lineWidth = 1 + 3 * a;
        ctx.beginPath();
        ctx.moveTo(x0, this.y(i));
        ctx.lineTo(x1, this.y(j));
        ctx.stroke();
        // A box per head behind the attended token, split into one slice per head.
        const slice = this.labelW / heads.length;
        const bx = side === "left" ? this.rightX() + n * slice : n * slice;
        ctx.globalAlpha = 0.1 + 0.7 * a;
        ctx.fillRect(bx, TOP + other * ROW + 1, slice, ROW - 2);
      }
    });
    ctx.globalAlpha = 1;
  }

  labels(ctx) {
    const { T, tokens } = this.model;
    const text = cssVar("--fg");
    const muted = cssVar("--muted");
    const generated = cssVar("--generated");
    const accent = cssVar("--accent");
    ctx.font = "600 12px system-ui, sans-serif";
    ctx.fillStyle = muted;
    ctx.textAlign = "right";
    ctx.fillText("query", this.labelW - 4, 16);
    ctx.textAlign = "left";
    ctx.fillText("key", this.rightX() + 4, 16);
    ctx.font = FONT;
    ctx.textBaseline = "middle";
    const single = this.focus && this.focus.side === "left" && this.heads.size === 1;
    for (let i = 0; i < T; i++) {
      const label = tokenLabel(tokens[i].text, 18);
      const focused = this.focus && this.focus.index === i;
      if (i === this.query) {
        ctx.strokeStyle = accent;
        ctx.lineWidth = 1.5;
        ctx.strokeRect(1, TOP + i * ROW + 1, this.labelW - 2, ROW - 2);
      }
      ctx.fillStyle = tokens[i].generated ? generated : text;
      ctx.font = focused && this.focus.side === "left" ? `700 ${FONT}` : FONT;
      ctx.textAlign = "right";
      ctx.fillText(label, this.labelW - 6, this.y(i));
      ctx.font = focused && this.focus.side === "right" ? `700 ${FONT}` : FONT;
      ctx.textAlign = "left";
      ctx.fillText(label, this.rightX() + 6, this.y(i));
      if (single) {
        const a = this.alpha([...this.heads][0], this.focus.index, i);
        ctx.fillStyle = a > 0 ? text : muted;
        ctx.font = "11px ui-monospace, monospace";
        ctx.fillText(fmt(a, 3), this.rightX() + this.labelW + 4, this.y(i));
        ctx.font = FONT;
      }
    }
  }
}
