// crowdchat's sign-in (the chat page's and the admin page's). Gradio's own form empties the
// user name after a wrong password; this one posts the same form to Gradio's /login and, when
// refused, says why and clears only the password.
const form = document.getElementById("sign-in");
const note = document.getElementById("note");
(form.username.value ? form.password : form.username).focus();
form.addEventListener("submit", async (event) => {
  event.preventDefault();
  note.textContent = "";
  let answer;
  try {
    answer = await fetch(form.getAttribute("action"), { method: "POST", body: new FormData(form) });
  } catch (err) {
    note.textContent = "The server did not answer: " + err.message;
    return;
  }
  if (answer.ok) {
    location.reload();
    return;
  }
  let detail = "";
  try {
    detail = (await answer.json()).detail;
  } catch (err) {
    detail = "";
  }
  note.textContent = answer.status === 400 ? "Incorrect credentials." : String(detail || answer.status);
  form.password.value = "";
  form.password.focus();
});
