// The message actions (ui/message_actions.py): ↻ under every reply, ‹ n/m › on a message that
// has versions and a reply's stats, drawn into each message's own button row of the chat from
// props.value (ui/message_meta.py: one item per message, in chat order). Clicks come back to
// Python as this component's 'regenerate' and 'branch' events with the message's index.
// Runs as gr.HTML's js_on_load: `element`, `props`, `trigger` and `watch` are Gradio's.
const ARROW =
  '<svg viewBox="0 0 24 24" width="14" height="14" fill="none" stroke="currentColor" ' +
  'stroke-width="2" stroke-linecap="round" stroke-linejoin="round" aria-hidden="true">' +
  '<path d="M21 12a9 9 0 1 1-3-6.7"/><path d="M21 4v5h-5"/></svg>';

function chat() {
  return document.querySelector("#chatbot");
}

function buttonRow(row) {
  const inside = row.querySelector(".message-buttons");
  if (inside) return inside;
  for (let next = row.nextElementSibling; next; next = next.nextElementSibling) {
    if (next.classList.contains("message-row")) return null;
    if (next.classList.contains("message-buttons")) return next;
  }
  return null;
}

function button(label, cls, html, onClick) {
  const b = document.createElement("button");
  b.type = "button";
  b.className = "cc-act " + cls;
  b.setAttribute("aria-label", label);
  b.title = label;
  b.innerHTML = html; // static markup only: no message text is ever put here
  b.addEventListener("click", (e) => {
    e.stopPropagation();
    onClick();
  });
  return b;
}

function decorate() {
  const root = chat();
  if (!root) return;
  const items = (props.value && props.value.items) || [];
  const rows = root.querySelectorAll(".message-row");
  rows.forEach((row, i) => {
    const bar = buttonRow(row);
    if (!bar) return;
    const item = items[i];
    const key = item ? JSON.stringify(item) + i : "";
    const old = bar.querySelector(".cc-actions");
    if (old && old.dataset.key === key) return;
    if (old) old.remove();
    if (!key) return;
    const box = document.createElement("span");
    box.className = "cc-actions";
    box.dataset.key = key;
    if (item.branches > 1) {
      const nav = document.createElement("span");
      nav.className = "cc-branch";
      nav.append(
        button("Previous version", "cc-prev", "‹", () => trigger("branch", { index: i, step: -1 })),
      );
      const where = document.createElement("span");
      where.className = "cc-branch-n";
      where.textContent = `${item.branch}/${item.branches}`;
      nav.append(where);
      nav.append(
        button("Next version", "cc-next", "›", () => trigger("branch", { index: i, step: 1 })),
      );
      box.append(nav);
    }
    if (item.role === "assistant") {
      box.append(
        button("Regenerate", "cc-regen", ARROW, () => trigger("regenerate", { index: i })),
      );
      if (item.stats) {
        const stats = document.createElement("span");
        stats.className = "cc-stats";
        stats.textContent = item.stats;
        box.append(stats);
      }
    }
    bar.append(box);
  });
}

let pending = false;
function soon() {
  if (pending) return;
  pending = true;
  requestAnimationFrame(() => {
    pending = false;
    decorate();
  });
}

watch("value", soon);
// the chat re-renders its rows as messages stream and change: draw again after each change
const observer = new MutationObserver(soon);
function attach() {
  const root = chat();
  if (!root) return setTimeout(attach, 200);
  observer.observe(root, { childList: true, subtree: true });
  soon();
}
attach();
