() => {
  // The chat page's own script (run once by Gradio as the page loads; ui/pages.py passes it):
  // the keyboard, the dialogs, the drawer on phones and the light/dark choice. The theme is
  // the one thing the page keeps in localStorage: nothing of a conversation is ever put there.
  const THEME_KEY = "crowdchat-theme";
  const PHONE = window.matchMedia("(max-width: 768px)");

  function visible(el) {
    return !!el && el.offsetParent !== null;
  }

  function button(id) {
    const el = document.getElementById(id);
    return el && el.tagName === "BUTTON" ? el : el && el.querySelector("button");
  }

  function setTheme(mode) {
    document.body.classList.toggle("dark", mode === "dark");
    const toggle = button("theme-toggle");
    if (toggle) toggle.setAttribute("aria-pressed", String(mode === "dark"));
  }

  function sidebar() {
    return document.querySelector(".sidebar");
  }

  const crowdchat = {
    toggleTheme() {
      const mode = document.body.classList.contains("dark") ? "light" : "dark";
      localStorage.setItem(THEME_KEY, mode);
      setTheme(mode);
    },
    openDialog(name) {
      crowdchat.closeDialogs();
      document.body.classList.add("cc-dialog-" + name);
      const dialog = document.getElementById(name + "-dialog");
      const first = dialog && dialog.querySelector("textarea, input, button");
      if (first) setTimeout(() => first.focus(), 0);
    },
    closeDialogs() {
      for (const c of [...document.body.classList]) {
        if (c.startsWith("cc-dialog-")) document.body.classList.remove(c);
      }
    },
    emptyBox() {
      // the message box as Send takes its text (what the box holds goes as the event's input)
      const box = document.querySelector("#message textarea");
      if (box) {
        box.value = "";
        box.dispatchEvent(new Event("input", { bubbles: true }));
      }
    },
    dialogOpen() {
      return [...document.body.classList].some((c) => c.startsWith("cc-dialog-"));
    },
    closeDrawerOnPhone() {
      const side = sidebar();
      if (PHONE.matches && side && side.classList.contains("open")) {
        side.querySelector(".toggle-button").click();
      }
    },
  };
  window.crowdchat = crowdchat;

  // the header's icon buttons say what they do (Gradio's Button takes no label of its own)
  const LABELS = {
    "new-chat-top": "New chat (Ctrl+Shift+O)",
    "theme-toggle": "Light or dark",
    "settings-open": "Settings",
    "settings-close": "Close",
    "share-close": "Close",
  };
  const label = () => {
    for (const [id, text] of Object.entries(LABELS)) {
      const b = button(id);
      if (b) {
        b.setAttribute("aria-label", text);
        b.title = text;
      }
    }
  };
  label();
  setTimeout(label, 1000);

  const saved = localStorage.getItem(THEME_KEY);
  if (saved === "dark" || saved === "light") setTheme(saved);

  // a phone opens on the chat: the conversations are a drawer behind the ☰ button
  const closeAtStart = () => {
    if (sidebar()) crowdchat.closeDrawerOnPhone();
    else setTimeout(closeAtStart, 100);
  };
  closeAtStart();

  document.addEventListener("keydown", (e) => {
    const key = e.key.toLowerCase();
    if ((e.ctrlKey || e.metaKey) && e.shiftKey && key === "o") {
      e.preventDefault();
      const fresh = button("new-chat");
      if (fresh) fresh.click();
      const box = document.querySelector("#message textarea");
      if (box) setTimeout(() => box.focus(), 0);
    } else if (e.key === "Escape") {
      if (crowdchat.dialogOpen()) {
        crowdchat.closeDialogs();
      } else {
        const stop = button("stop");
        if (visible(stop)) {
          e.preventDefault();
          stop.click();
        }
      }
    }
  });
  document.addEventListener("click", (e) => {
    // a click on the dimmed page around a dialog closes it
    if (e.target && e.target.classList && e.target.classList.contains("cc-backdrop")) {
      crowdchat.closeDialogs();
    }
  });
}
