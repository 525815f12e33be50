// The fields OpenAI's API sends with an answer besides its framing and type (values made up,
// names and sizes as sent), one expression: mock-llm's `x-mock-headers: provider` adds them to
// its heads, and the hot-path fixture (bench/micro/fixture) parses them, so both are the same
// twenty fields.
b"date: Tue, 01 Dec 2026 12:00:00 GMT\r\n\
access-control-expose-headers: X-Request-ID\r\n\
openai-organization: user-abcdefghijklmnopqrstuvwx\r\n\
openai-processing-ms: 412\r\n\
openai-version: 2020-10-01\r\n\
x-ratelimit-limit-requests: 10000\r\n\
x-ratelimit-limit-tokens: 30000000\r\n\
x-ratelimit-remaining-requests: 9999\r\n\
x-ratelimit-remaining-tokens: 29999968\r\n\
x-ratelimit-reset-requests: 6ms\r\n\
x-ratelimit-reset-tokens: 0s\r\n\
x-request-id: req_0123456789abcdef0123456789abcdef\r\n\
strict-transport-security: max-age=31536000; includeSubDomains; preload\r\n\
cf-cache-status: DYNAMIC\r\n\
set-cookie: __cf_bm=AbCdEfGhIjKlMnOpQrStUvWxYz0123456789.abcdefghij-1764590400-1.0.1.1-AbCdEfGhIjKlMnOpQrStUvWxYz0123456789AbCdEfGhIjKlMnOpQrStUvWxYz0123456789abcd; path=/; expires=Tue, 01-Dec-26 12:30:00 GMT; domain=.api.openai.com; HttpOnly; Secure; SameSite=None\r\n\
x-content-type-options: nosniff\r\n\
set-cookie: _cfuvid=AbCdEfGhIjKlMnOpQrStUvWxYz0123456789.abc-1764590400000-0.0.1.1-604800000; path=/; domain=.api.openai.com; HttpOnly; Secure; SameSite=None\r\n\
server: cloudflare\r\n\
cf-ray: 8f0123456789abcd-FRA\r\n\
alt-svc: h3=\":443\"; ma=86400\r\n"
