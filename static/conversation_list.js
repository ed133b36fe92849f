// The sidebar's conversation list (ui/conversation_list.py), drawn from props.value:
// {items: [{id, title, t}], open, more, query?, hits?}. Titles and snippets go in as text
// nodes only. What the user does goes back to Python as this component's events: 'pick',
// 'rename', 'remove', 'share_link', 'more' and 'find' (the search box, debounced). (Not
// 'share': Gradio's page takes a component's "share" for its own Hugging Face sharing.)
// Runs as gr.HTML's js_on_load: `element`, `props`, `trigger` and `watch` are Gradio's.
const find = element.querySelector(".cc-find");
const list = element.querySelector(".cc-list");
const DEBOUNCE_MS = 250;
const MARK_OPEN = "\u0001";
const MARK_CLOSE = "\u0002";
let menuFor = null; // the id whose menu is open
let confirmFor = null; // the id whose delete asks for a confirmation
let renaming = null; // the id whose title is being edited
let hits = null; // the last search answer, for `hitsFor`
let hitsFor = null;
let askedMore = false;

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function groupOf(t) {
  const now = new Date();
  const day = (n) => new Date(now.getFullYear(), now.getMonth(), now.getDate() - n).getTime();
  const ms = t * 1000;
  if (ms >= day(0)) return "Today";
  if (ms >= day(1)) return "Yesterday";
  if (ms >= day(7)) return "Previous 7 days";
  return "Older";
}

function titleOf(item) {
  return item.title || "New chat";
}

function closeDrawerOnPhone() {
  if (window.crowdchat) window.crowdchat.closeDrawerOnPhone();
}

function pick(id, message) {
  const v = props.value || {};
  v.open = id;
  menuFor = confirmFor = null;
  render();
  trigger("pick", message == null ? { id } : { id, message });
  closeDrawerOnPhone();
}

function menu(item) {
  const m = el("div", "cc-menu");
  m.setAttribute("role", "menu");
  const entry = (label, cls, act) => {
    const b = el("button", "cc-menu-item " + cls, label);
    b.type = "button";
    b.setAttribute("role", "menuitem");
    b.addEventListener("click", (e) => {
      e.stopPropagation();
      act();
    });
    m.append(b);
  };
  const link = (label, cls, href) => {
    const a = el("a", "cc-menu-item " + cls, label);
    a.href = href;
    a.setAttribute("download", "");
    a.setAttribute("role", "menuitem");
    a.addEventListener("click", () => {
      menuFor = null;
      setTimeout(render, 0);
    });
    m.append(a);
  };
  const id = encodeURIComponent(item.id);
  entry("Rename", "cc-rename", () => {
    renaming = item.id;
    menuFor = null;
    render();
  });
  entry("Share", "cc-share", () => {
    menuFor = null;
    render();
    trigger("share_link", { id: item.id });
  });
  link("Export as Markdown", "cc-export-md", `export/${id}.md`);
  link("Export as JSON", "cc-export-json", `export/${id}.json`);
  entry("Delete", "cc-delete", () => {
    confirmFor = item.id;
    menuFor = null;
    render();
  });
  return m;
}

function renameBox(item) {
  const input = el("input", "cc-rename-box");
  input.value = item.title;
  input.setAttribute("aria-label", "New title");
  let done = false;
  const finish = (save) => {
    if (done) return;
    done = true;
    renaming = null;
    const title = input.value.trim();
    if (save && title && title !== item.title) {
      item.title = title;
      trigger("rename", { id: item.id, title });
    }
    render();
  };
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter") finish(true);
    else if (e.key === "Escape") {
      e.stopPropagation();
      finish(false);
    }
  });
  input.addEventListener("blur", () => finish(true));
  input.addEventListener("click", (e) => e.stopPropagation());
  setTimeout(() => {
    input.focus();
    input.select();
  }, 0);
  return input;
}

function confirmRow(item) {
  const row = el("div", "cc-confirm");
  row.append(el("span", "cc-confirm-text", `Delete “${titleOf(item)}”?`));
  const yes = el("button", "cc-confirm-yes", "Delete");
  const no = el("button", "cc-confirm-no", "Cancel");
  yes.type = no.type = "button";
  yes.addEventListener("click", (e) => {
    e.stopPropagation();
    const v = props.value || {};
    v.items = (v.items || []).filter((x) => x.id !== item.id);
    confirmFor = null;
    render();
    trigger("remove", { id: item.id });
  });
  no.addEventListener("click", (e) => {
    e.stopPropagation();
    confirmFor = null;
    render();
  });
  row.append(yes, no);
  return row;
}

function itemRow(item, open) {
  const li = el("li", "cc-item");
  li.dataset.id = item.id;
  if (item.id === open) {
    li.classList.add("cc-open");
    li.setAttribute("aria-current", "page");
  }
  if (confirmFor === item.id) {
    li.append(confirmRow(item));
    return li;
  }
  if (renaming === item.id) {
    li.append(renameBox(item));
    return li;
  }
  const go = el("button", "cc-title", titleOf(item));
  go.type = "button";
  go.title = titleOf(item);
  go.addEventListener("click", () => pick(item.id));
  const more = el("button", "cc-dots", "⋯");
  more.type = "button";
  more.setAttribute("aria-label", `Options for ${titleOf(item)}`);
  more.setAttribute("aria-haspopup", "menu");
  more.addEventListener("click", (e) => {
    e.stopPropagation();
    menuFor = menuFor === item.id ? null : item.id;
    confirmFor = null;
    render();
  });
  li.append(go, more);
  if (menuFor === item.id) li.append(menu(item));
  return li;
}

function marked(text) {
  // the search's matching words, between MARK_OPEN and MARK_CLOSE, in bold
  const out = el("span", "cc-snippet");
  const parts = text.split(MARK_OPEN);
  out.append(document.createTextNode(parts[0]));
  for (const part of parts.slice(1)) {
    const [hit, rest] = part.split(MARK_CLOSE);
    out.append(el("b", "", hit));
    out.append(document.createTextNode(rest || ""));
  }
  return out;
}

function hitRow(hit) {
  const li = el("li", "cc-item cc-hit");
  li.dataset.id = hit.id;
  const go = el("button", "cc-title", "");
  go.type = "button";
  go.append(el("span", "cc-hit-title", hit.title || "New chat"));
  if (hit.where !== "title") go.append(marked(hit.snippet));
  go.addEventListener("click", () => pick(hit.id, hit.message));
  li.append(go);
  return li;
}

function renderHits(query) {
  if (hits === null || hitsFor !== query) {
    list.append(el("p", "cc-empty", "Searching…"));
    return;
  }
  if (!hits.length) {
    list.append(el("p", "cc-empty", `Nothing of yours matches “${query}”.`));
    return;
  }
  const ul = el("ul", "cc-items");
  for (const hit of hits) ul.append(hitRow(hit));
  list.append(ul);
}

const sentinel = el("div", "cc-more", "Loading more…");
const observer = new IntersectionObserver((entries) => {
  if (entries.some((e) => e.isIntersecting) && !askedMore) {
    askedMore = true;
    trigger("more");
  }
});
observer.observe(sentinel);

function render() {
  const v = props.value || {};
  if (v.hits != null && v.query != null) {
    hits = v.hits;
    hitsFor = v.query;
  }
  list.replaceChildren();
  const query = find.value;
  if (query.trim()) {
    renderHits(query);
    return;
  }
  let group = null;
  let ul = null;
  for (const item of v.items || []) {
    const g = groupOf(item.t);
    if (g !== group) {
      group = g;
      list.append(el("h3", "cc-group", g));
      ul = el("ul", "cc-items");
      list.append(ul);
    }
    ul.append(itemRow(item, v.open));
  }
  if (!(v.items || []).length) list.append(el("p", "cc-empty", "No conversations yet."));
  if (v.more) list.append(sentinel);
}

let timer = null;
find.addEventListener("input", () => {
  clearTimeout(timer);
  if (!find.value.trim()) {
    render();
    return;
  }
  render();
  timer = setTimeout(() => trigger("find", { text: find.value }), DEBOUNCE_MS);
});
find.addEventListener("keydown", (e) => {
  if (e.key === "Escape" && find.value) {
    e.stopPropagation();
    find.value = "";
    render();
  }
});
document.addEventListener("click", (e) => {
  if ((menuFor || confirmFor) && !element.contains(e.target)) {
    menuFor = confirmFor = null;
    render();
  }
});
watch("value", () => {
  askedMore = false;
  render();
});
render();
