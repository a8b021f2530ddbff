// The dikkat attention report (dikkat.viz.report; docs/report.md): a head view and a model view,
// drawn from the JSON in <script id="dikkat-data">. Plain browser JavaScript, no libraries, no
// network. Every piece of text goes in through textContent (never innerHTML), so a token such as
// "<script>" or "&amp;" is shown as it is written.
"use strict";
(function () {
  const data = JSON.parse(document.getElementById("dikkat-data").textContent);
  const Tq = data.queries.length;
  const Tk = data.keys.length;
  const MIN_WEIGHT = 0.01; // fainter lines are not drawn: invisible, and they would swamp the page
  const ROW = 22; // px per token in the head view
  const LABEL = 250; // px for each column of tokens (MAX_CHARS of 13 px monospace fit)
  const GAP = 280; // px between the two columns, where the lines run
  const MAX_CHARS = 30; // longer labels are cut; the tooltip has the whole label
  const CELL = 72; // px of the longer side of each heat map in the model view

  // what is shown: the layer, which heads, and the token under the pointer (null: none)
  const state = { layer: 0, heads: data.heads.map(() => true), focus: null };

  // how much query row i attends to key j, in head h of layer l (weights are stored × scale)
  const weight = (l, h, i, j) => data.weights[l][h][i * Tk + j] / data.scale;

  // one colour per head, spread around the hue circle by the golden angle
  const colours = data.heads.map((_, h) => `hsl(${(h * 137.508) % 360}, 70%, 42%)`);

  const svg = document.getElementById("head-view");
  const SVG_NS = svg.namespaceURI; // the SVG namespace, read off the page's own <svg>

  function make(tag, attrs = {}, text = null, ns = null) {
    const node = ns ? document.createElementNS(ns, tag) : document.createElement(tag);
    for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, String(value));
    if (text !== null) node.textContent = text;
    return node;
  }
  const makeSvg = (tag, attrs, text = null) => make(tag, attrs, text, SVG_NS);
  const shorten = (s) => (s.length > MAX_CHARS ? s.slice(0, MAX_CHARS - 1) + "…" : s);

  // ---- the header: title, and what the two columns are
  const SIDES = {
    self: "left: the query tokens, right: the tokens they attend to",
    cross: "left: the target (queries), right: the source (keys)",
    image: "left: the query tokens, right: the image patches (keys)",
  };
  document.getElementById("title").textContent = data.title || "attention";
  document.getElementById("kind").textContent =
    `${data.kind} attention, ${data.layers.length} layers × ${data.heads.length} heads; ` +
    `${SIDES[data.kind]}.`;

  // ---- controls: the layer menu and a coloured check box per head
  const select = document.getElementById("layer");
  data.layers.forEach((name, l) => select.append(make("option", { value: l }, name)));
  select.addEventListener("change", () => {
    state.layer = Number(select.value);
    update();
  });
  const boxes = data.heads.map((head, h) => {
    const box = make("input", { type: "checkbox", "data-head": h });
    box.checked = true;
    box.addEventListener("change", () => {
      state.heads[h] = box.checked;
      update();
    });
    const chip = make("label", { class: "chip", style: `--c: ${colours[h]}` });
    chip.append(box, data.head_labels[h]);
    document.getElementById("heads").append(chip);
    return box;
  });

  // ---- head view: queries on the left, keys on the right, the lines below the tokens
  svg.setAttribute("width", 2 * LABEL + GAP);
  svg.setAttribute("height", Math.max(Tq, Tk) * ROW);
  const lines = makeSvg("g", { id: "lines" });
  svg.append(lines);
  const middle = (i) => i * ROW + ROW / 2;

  function addToken(side, i, label, tip) {
    const left = side === "q";
    const token = makeSvg("g", { class: `token ${side}`, "data-index": i });
    token.append(makeSvg("title", {}, tip));
    token.append(makeSvg("rect", { x: left ? 0 : LABEL + GAP, y: i * ROW, width: LABEL, height: ROW }));
    const x = left ? LABEL - 8 : LABEL + GAP + 8;
    const anchor = left ? "end" : "start";
    token.append(makeSvg("text", { x, y: middle(i), "text-anchor": anchor }, shorten(label)));
    token.addEventListener("mouseenter", () => {
      state.focus = { side, index: i };
      showFocus();
    });
    token.addEventListener("mouseleave", () => {
      state.focus = null;
      showFocus();
    });
    svg.append(token);
  }
  data.queries.forEach((t, i) => addToken("q", i, t, `${t}\nquery row ${i}, position ${data.rows[i]}`));
  data.keys.forEach((t, j) => addToken("k", j, t, `${t}\nkey ${j}`));

  // a line from query i to key j per visible head, its opacity the weight
  function drawLines() {
    lines.replaceChildren();
    data.heads.forEach((_, h) => {
      if (!state.heads[h]) return;
      for (let i = 0; i < Tq; i++) {
        for (let j = 0; j < Tk; j++) {
          const w = weight(state.layer, h, i, j);
          if (w < MIN_WEIGHT) continue;
          lines.append(makeSvg("line", {
            class: "attn", x1: LABEL, y1: middle(i), x2: LABEL + GAP, y2: middle(j),
            stroke: colours[h], "stroke-opacity": w.toFixed(4), "data-q": i, "data-k": j, "data-h": h,
          }));
        }
      }
    });
  }

  // the token under the pointer keeps its own lines; every other line fades
  function showFocus() {
    const f = state.focus;
    for (const token of svg.querySelectorAll(".token")) {
      const on = f !== null && token.classList.contains(f.side) && Number(token.dataset.index) === f.index;
      token.classList.toggle("focus", on);
    }
    for (const line of lines.children) {
      line.classList.toggle("dim", f !== null && Number(line.dataset[f.side]) !== f.index);
    }
  }

  // ---- model view: a heat map per layer (down) and head (across); white 0, full colour 1
  const grid = document.getElementById("model-view");
  grid.style.gridTemplateColumns = `auto repeat(${data.heads.length}, auto)`;
  const px = CELL / Math.max(Tq, Tk); // css pixels per weight

  function rgbOf(colour) { // the sRGB bytes of a CSS colour, read back from one painted pixel
    const ctx = make("canvas", { width: 1, height: 1 }).getContext("2d");
    ctx.fillStyle = colour;
    ctx.fillRect(0, 0, 1, 1);
    return ctx.getImageData(0, 0, 1, 1).data;
  }
  const rgb = colours.map(rgbOf);

  function paint(canvas, l, h) {
    const ctx = canvas.getContext("2d");
    const image = ctx.createImageData(Tk, Tq); // one pixel per weight, row i = query i
    const stored = data.weights[l][h];
    for (let p = 0; p < stored.length; p++) {
      const a = Math.min(1, stored[p] / data.scale);
      for (let c = 0; c < 3; c++) image.data[4 * p + c] = Math.round(255 - a * (255 - rgb[h][c]));
      image.data[4 * p + 3] = 255;
    }
    ctx.putImageData(image, 0, 0);
  }

  grid.append(make("span"));
  data.head_labels.forEach((label) => grid.append(make("span", { class: "label head-label" }, label)));
  const cells = [];
  data.layers.forEach((name, l) => {
    grid.append(make("span", { class: "label" }, name));
    data.heads.forEach((head, h) => {
      const cell = make("canvas", {
        class: "cell", width: Tk, height: Tq, "data-layer": l, "data-head": h,
        title: `${name}, ${data.head_labels[h]}: click to show it in the head view`,
      });
      cell.style.width = `${Math.max(4, Math.round(Tk * px))}px`;
      cell.style.height = `${Math.max(4, Math.round(Tq * px))}px`;
      paint(cell, l, h);
      cell.addEventListener("click", () => showHead(l, h));
      grid.append(cell);
      cells.push(cell);
    });
  });

  // a click on a heat map: the head view shows that layer, and that head alone
  function showHead(l, h) {
    state.layer = l;
    select.value = String(l);
    state.heads = data.heads.map((_, k) => k === h);
    boxes.forEach((box, k) => { box.checked = state.heads[k]; });
    update();
    svg.scrollIntoView({ block: "nearest" });
  }

  function update() {
    drawLines();
    showFocus();
    for (const cell of cells) {
      const shown = Number(cell.dataset.layer) === state.layer && state.heads[Number(cell.dataset.head)];
      cell.classList.toggle("selected", shown);
    }
  }

  update();
  document.documentElement.dataset.ready = "true"; // the page is drawn (tests wait for this)
})();
