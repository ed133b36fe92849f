"""Who is calling, and may they: one identity model in front of every route (chat page, API,
/metrics, /admin), the anonymous browser cookie, login throttling and the request body cap.

Parts: `config` (AppConfig, the server's flags), `identity` (Identity, who a request is),
`middleware` (Doors, the ASGI gate), `browser_id` (the signed cookie), `throttle` (sliding
windows: sign-in failures, new identities). Import them from their modules."""
