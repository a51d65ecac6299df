// A small Markdown renderer for model replies: fenced code blocks, headings, lists,
// paragraphs, inline code, bold, italics and http(s) links. Everything is HTML-escaped
// first, so a reply can never inject markup. An unclosed fence (a reply still streaming)
// renders as a code block up to the end.
"use strict";

function escapeHtml(text) {
  return text.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
    .replace(/"/g, "&quot;").replace(/'/g, "&#39;");
}

function renderInline(text) {
  const codes = [];
  let out = escapeHtml(text).replace(/`([^`]+)`/g, (_, code) => {
    codes.push(code);
    return "\u0000" + (codes.length - 1) + "\u0000";
  });
  out = out.replace(/\*\*([^*]+)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^*])\*([^*\s][^*]*)\*/g, "$1<em>$2</em>")
    .replace(/\[([^\]]+)\]\((https?:\/\/[^\s)]+)\)/g,
      '<a href="$2" rel="noopener noreferrer" target="_blank">$1</a>');
  return out.replace(/\u0000(\d+)\u0000/g, (_, i) => "<code>" + codes[Number(i)] + "</code>");
}

function renderBlocks(text) {
  const html = [];
  let list = null;
  let para = [];
  const flushPara = () => {
    if (para.length) html.push("<p>" + para.map(renderInline).join("<br>") + "</p>");
    para = [];
  };
  const closeList = () => {
    if (list) html.push("</" + list + ">");
    list = null;
  };
  for (const line of text.split("\n")) {
    const heading = /^(#{1,6})\s+(.*)$/.exec(line);
    const bullet = /^\s*[-*]\s+(.*)$/.exec(line);
    const numbered = /^\s*\d+[.)]\s+(.*)$/.exec(line);
    if (heading) {
      flushPara(); closeList();
      const level = heading[1].length;
      html.push("<h" + level + ">" + renderInline(heading[2]) + "</h" + level + ">");
    } else if (bullet || numbered) {
      flushPara();
      const kind = bullet ? "ul" : "ol";
      if (list !== kind) { closeList(); html.push("<" + kind + ">"); list = kind; }
      html.push("<li>" + renderInline((bullet || numbered)[1]) + "</li>");
    } else if (!line.trim()) {
      flushPara(); closeList();
    } else {
      closeList();
      para.push(line);
    }
  }
  flushPara(); closeList();
  return html.join("");
}

function renderMarkdown(text) {
  const parts = [];
  const fence = /```([\w+-]*)[^\n]*\n([\s\S]*?)(```|$)/g;
  let last = 0;
  let match;
  while ((match = fence.exec(text)) !== null) {
    parts.push(renderBlocks(text.slice(last, match.index)));
    const lang = match[1] ? ' class="language-' + escapeHtml(match[1]) + '"' : "";
    parts.push("<pre><code" + lang + ">" + escapeHtml(match[2].replace(/\n$/, "")) + "</code></pre>");
    last = fence.lastIndex;
    if (match[3] === "") break;
  }
  parts.push(renderBlocks(text.slice(last)));
  return parts.join("");
}
