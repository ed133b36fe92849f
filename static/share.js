// The share page: a Copy button on every code block. The clipboard API needs a secure
// context (https or localhost); elsewhere the block's text is selected and copied the old way.
for (const pre of document.querySelectorAll(".message pre")) {
  const button = document.createElement("button");
  button.type = "button";
  button.className = "copy";
  button.textContent = "Copy";
  button.addEventListener("click", async () => {
    const code = pre.querySelector("code") || pre;
    const text = code.innerText;
    try {
      await navigator.clipboard.writeText(text);
    } catch (err) {
      const range = document.createRange();
      range.selectNodeContents(code);
      const selection = window.getSelection();
      selection.removeAllRanges();
      selection.addRange(range);
      document.execCommand("copy");
    }
    button.textContent = "Copied";
    setTimeout(() => { button.textContent = "Copy"; }, 1500);
  });
  pre.append(button);
}
