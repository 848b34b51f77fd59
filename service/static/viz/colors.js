// Colour ramps, head colours, number and token formatting shared by the views.

// Viridis anchors at 0, 0.25, 0.5, 0.75, 1 (the ramp of the PNG heatmaps too).
const ANCHORS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];

/** 256 × RGB bytes: α in [0, 1] → colour. */
export const VIRIDIS = (() => {
  const lut = new Uint8ClampedArray(256 * 3);
  for (let i = 0; i < 256; i++) {
    const x = (i / 255) * (ANCHORS.length - 1);
    const a = Math.min(Math.floor(x), ANCHORS.length - 2);
    const f = x - a;
    for (let c = 0; c < 3; c++) {
      lut[i * 3 + c] = Math.round(ANCHORS[a][c] * (1 - f) + ANCHORS[a + 1][c] * f);
    }
  }
  return lut;
})();

export function viridisCss(value) {
  const i = Math.max(0, Math.min(255, Math.round(value * 255))) * 3;
  return `rgb(${VIRIDIS[i]}, ${VIRIDIS[i + 1]}, ${VIRIDIS[i + 2]})`;
}

/** Diverging blue–neutral–red for signed vector entries; t in [-1, 1]. */
export function divergingRgb(t, dark) {
  const base = dark ? [40, 42, 48] : [250, 250, 250];
  const end = t < 0 ? [59, 110, 214] : [214, 72, 59];
  const f = Math.min(1, Math.abs(t));
  return base.map((b, c) => Math.round(b * (1 - f) + end[c] * f));
}

// One colour per head: twelve well-separated hues, then golden-angle hues past twelve.
const HEAD_COLOURS = ["#4e79a7", "#f28e2b", "#e15759", "#59a14f", "#b07aa1", "#17becf",
  "#edc948", "#9c755f", "#ff9da7", "#76b7b2", "#bcbd22", "#8c6d31"];

export function headColour(h) {
  if (h < HEAD_COLOURS.length) return HEAD_COLOURS[h];
  return `hsl(${Math.round((h * 137.508) % 360)}, 62%, 55%)`;
}

export function headRgb(h) {
  const c = headColour(h);
  if (c.startsWith("#")) return [1, 3, 5].map((i) => parseInt(c.slice(i, i + 2), 16));
  const probe = document.createElement("canvas").getContext("2d");
  probe.fillStyle = c;
  const hex = probe.fillStyle;
  return [1, 3, 5].map((i) => parseInt(hex.slice(i, i + 2), 16));
}

/** A token as a short visible label: spaces, newlines and tabs drawn as symbols. */
export function tokenLabel(text, max = 14) {
  let s = text.replace(/ /g, "·").replace(/\n/g, "↵").replace(/\t/g, "⇥").replace(/\r/g, "␍");
  if (s === "") s = "∅";
  return s.length > max ? `${s.slice(0, max - 1)}…` : s;
}

export function fmt(x, digits = 4) {
  if (x === -Infinity) return "−∞";
  if (x === Infinity) return "∞";
  if (Number.isNaN(x)) return "NaN";
  const s = x.toFixed(digits);
  return s.startsWith("-") ? `−${s.slice(1)}` : s;
}

export function cssVar(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
}

export function isDark() {
  return document.documentElement.dataset.theme === "dark";
}

/** Size a canvas for CSS pixels w × h at the device pixel ratio; returns its 2D context. */
export function sizeCanvas(canvas, w, h) {
  const ratio = window.devicePixelRatio || 1;
  canvas.width = Math.max(1, Math.round(w * ratio));
  canvas.height = Math.max(1, Math.round(h * ratio));
  canvas.style.width = `${w}px`;
  canvas.style.height = `${h}px`;
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  return ctx;
}
