// A small markdown renderer for model output. It builds DOM nodes with createElement and
// textContent only (never innerHTML), so no text the model writes can become markup or script.
// Covers what chat answers use: fenced code, headings, lists, block quotes, tables are left as text,
// paragraphs, and inline code, bold, italic and http(s) links.
"use strict";

(function (root) {
  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function safeHref(url) {
    try {
      const u = new URL(url, "http://invalid.invalid/");
      if ((u.protocol === "http:" || u.protocol === "https:") && /^https?:\/\//i.test(url)) return u.href;
    } catch (e) { /* not a URL: plain text */ }
    return null;
  }

  // Inline spans: `code`, **bold**, *italic* / _italic_, [text](url). Appends to `parent`.
  const INLINE = /(`+)([\s\S]*?[^`])\1(?!`)|\*\*([^*\n]+?)\*\*|__([^_\n]+?)__|\*([^*\s][^*\n]*?)\*|(?:^|(?<=\W))_([^_\s][^_\n]*?)_(?=\W|$)|\[([^\]\n]+)\]\(([^)\s]+)\)/g;

  function inline(parent, text) {
    const re = new RegExp(INLINE.source, "g"); // own lastIndex: bold/italic/link text recurse
    let last = 0;
    let m;
    while ((m = re.exec(text)) !== null) {
      if (m.index > last) parent.appendChild(document.createTextNode(text.slice(last, m.index)));
      if (m[1] !== undefined) parent.appendChild(el("code", "inline", m[2]));
      else if (m[3] !== undefined || m[4] !== undefined) inline(parent.appendChild(el("strong")), m[3] ?? m[4]);
      else if (m[5] !== undefined || m[6] !== undefined) inline(parent.appendChild(el("em")), m[5] ?? m[6]);
      else {
        const href = safeHref(m[8]);
        if (href) {
          const a = el("a");
          a.href = href;
          a.target = "_blank";
          a.rel = "noopener noreferrer nofollow";
          inline(a, m[7]);
          parent.appendChild(a);
        } else {
          parent.appendChild(document.createTextNode(m[0]));
        }
      }
      if (!m[0]) re.lastIndex++; // (no alternative matches empty; never loop if one ever does)
      last = re.lastIndex;
    }
    if (last < text.length) parent.appendChild(document.createTextNode(text.slice(last)));
  }

  function inlineLines(parent, lines) {
    lines.forEach((line, i) => {
      if (i) parent.appendChild(el("br"));
      inline(parent, line);
    });
  }

  const FENCE = /^\s{0,3}(```+|~~~+)\s*([\w+#.-]*)/;
  const HEADING = /^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
  const BULLET = /^\s{0,3}[-*+]\s+(.*)$/;
  const ORDERED = /^\s{0,3}(\d{1,9})[.)]\s+(.*)$/;
  const QUOTE = /^\s{0,3}>\s?(.*)$/;
  const RULE = /^\s{0,3}([-*_])(\s*\1){2,}\s*$/;

  // Render `text` into a DocumentFragment.
  function render(text) {
    const out = document.createDocumentFragment();
    const lines = String(text).replace(/\r\n?/g, "\n").split("\n");
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if ((m = FENCE.exec(line))) {
        const close = m[1];
        const body = [];
        i++;
        while (i < lines.length && !lines[i].trim().startsWith(close)) body.push(lines[i++]);
        i++; // the closing fence (or the end while the answer is still streaming)
        const pre = el("pre", "code");
        if (m[2]) pre.appendChild(el("span", "lang", m[2]));
        pre.appendChild(el("code", m[2] ? "language-" + m[2].replace(/[^\w-]/g, "") : "", body.join("\n")));
        out.appendChild(pre);
      } else if (!line.trim()) {
        i++;
      } else if ((m = HEADING.exec(line))) {
        inline(out.appendChild(el("h" + Math.min(m[1].length + 2, 6), "md-h")), m[2]);
        i++;
      } else if (RULE.test(line)) {
        out.appendChild(el("hr"));
        i++;
      } else if (QUOTE.test(line)) {
        const body = [];
        while (i < lines.length && (m = QUOTE.exec(lines[i]))) { body.push(m[1]); i++; }
        const q = el("blockquote");
        q.appendChild(render(body.join("\n")));
        out.appendChild(q);
      } else if (BULLET.test(line) || ORDERED.test(line)) {
        const ordered = !BULLET.test(line);
        const re = ordered ? ORDERED : BULLET;
        const list = el(ordered ? "ol" : "ul");
        if (ordered) {
          const start = parseInt(ORDERED.exec(line)[1], 10);
          if (start !== 1) list.start = start;
        }
        while (i < lines.length && (m = re.exec(lines[i]))) {
          const item = [ordered ? m[2] : m[1]];
          i++;
          while (i < lines.length && /^\s{2,}\S/.test(lines[i]) && !re.test(lines[i])) item.push(lines[i++].trim());
          inlineLines(list.appendChild(el("li")), item);
        }
        out.appendChild(list);
      } else {
        const para = [];
        while (i < lines.length && lines[i].trim() && !FENCE.test(lines[i]) && !HEADING.test(lines[i]) &&
               !BULLET.test(lines[i]) && !ORDERED.test(lines[i]) && !QUOTE.test(lines[i])) {
          para.push(lines[i++]);
        }
        inlineLines(out.appendChild(el("p")), para);
      }
    }
    return out;
  }

  root.MoestreamMarkdown = { render };
})(window);
