"""rlhf/evaluation/judges.py: eval.py's pairwise judges, each a function (prompts, firsts, seconds) ->
P(the response shown first is better), and the position swap that debiases them:

- the LLM judge (--judge llm:MODEL): a local causal LM asked JUDGE_TEMPLATE (or --judge_template),
  read at its next token, P("A") / (P("A") + P("B"));
- the pairwise reward-model judge (--judge pairwise:MODEL): a sequence classifier shown both responses;
- the HTTP judge (--judge http:MODEL): an OpenAI-compatible /chat/completions endpoint.

eval.py asks each in both orders (position_debiased) and turns the probabilities into wins and ties.
"""

import json
import os
import re

import numpy as np
import torch

from rlhf import basics
from rlhf import data
from rlhf import sampling

JUDGE_TEMPLATE = (
    "Which response answers the prompt better? Answer with one letter, A or B.\n\n"
    "Prompt:\n{prompt}\n\nResponse A:\n{a}\n\nResponse B:\n{b}\n\nThe better response is"
)


# ============================================================================ the LLM judge
def answer_token_ids(tokenizer, letter):
    """Token ids that spell the answer `letter` as one token (with and without a leading space)."""
    ids = set()
    for text in (letter, " " + letter):
        toks = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(toks) == 1 and tokenizer.decode(toks) == text:  # not <unk>, nor " " with the letter dropped
            ids.add(toks[0])
    return sorted(ids)


def prompt_text(prompt):
    """A prompt as plain text for the judge to read (conversations as 'role: content' lines)."""
    if isinstance(prompt, str):
        return prompt.strip()
    return "\n".join(f"{m['role']}: {m['content']}" for m in prompt)


def fill_template(template, prompt, a, b):
    """The judge's question: {prompt}, {a} and {b} replaced in one pass (a response that writes
    "{b}" stays as written; other braces, e.g. JSON in the template, are left alone)."""
    values = {"prompt": prompt_text(prompt), "a": a.strip(), "b": b.strip()}
    return re.sub(r"\{(prompt|a|b)\}", lambda m: values[m.group(1)], template)


def load_judge_template(path):
    """--judge_template: the file's text, which must hold {prompt}, {a} and {b}."""
    if not path:
        return JUDGE_TEMPLATE
    if not os.path.isfile(path):
        basics.fail(f"--judge_template {path}: no such file; pass a text file holding {{prompt}}, {{a}} and {{b}}.")
    try:
        with open(path, encoding="utf-8") as f:
            template = f.read()
    except UnicodeDecodeError as e:
        basics.fail(f"--judge_template {path} is not UTF-8 text (byte {e.start} is {e.object[e.start:e.start + 1]!r}); "
                    "save it as UTF-8.")
    missing = [k for k in ("{prompt}", "{a}", "{b}") if k not in template]
    if missing:
        basics.fail(f"--judge_template {path} lacks {', '.join(missing)}: the judge would not see "
                    f"{'the prompt' if missing == ['{prompt}'] else 'both responses'}; write them where they go.")
    return template


def judge_input(tokenizer, prompt, a, b, template=JUDGE_TEMPLATE):
    """The judge's question, through its chat template when it has one."""
    text = fill_template(template, prompt, a, b)
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return text


@torch.no_grad()
def prob_first_better(model, tokenizer, prompts, firsts, seconds, batch_size=16, template=JUDGE_TEMPLATE):
    """P("A") / (P("A") + P("B")) at the judge's next token, shown `firsts` as A: (n,)."""
    a_ids, b_ids = answer_token_ids(tokenizer, "A"), answer_token_ids(tokenizer, "B")
    if not a_ids or not b_ids:
        basics.fail("the --judge llm model's tokenizer has no single token for 'A' or 'B'; use a judge model "
                    "whose vocabulary spells them (any instruction-tuned LM does).")
    texts = [judge_input(tokenizer, p, a, b, template) for p, a, b in zip(prompts, firsts, seconds)]
    probs = []
    for i in range(0, len(texts), batch_size):
        ids, mask = data.encode_prompts(tokenizer, texts[i:i + batch_size])  # left padded
        ids, mask = ids.to(model.device), mask.to(model.device)
        hidden = sampling.backbone(model)(input_ids=ids, attention_mask=mask, position_ids=sampling.position_ids(mask),
                                        use_cache=False).last_hidden_state[:, -1]  # (b, H) at the last token
        logits = sampling.lm_logits(model, hidden)  # (b, V): only the next token's logits, never (b, T, V)
        log_a = torch.logsumexp(logits[:, a_ids], -1)  # (b,) all spellings of "A"
        log_b = torch.logsumexp(logits[:, b_ids], -1)
        probs.append(torch.sigmoid(log_a - log_b).cpu())  # = P(A) / (P(A) + P(B))
    return torch.cat(probs).double().numpy()


def llm_judge(model, tokenizer, prompts, responses_a, responses_b, batch_size=16, template=JUDGE_TEMPLATE):
    """P(a is better than b) per prompt from a local causal LM, position-debiased: (n,)."""
    return position_debiased(lambda p, f, s: prob_first_better(model, tokenizer, p, f, s, batch_size, template),
                             prompts, responses_a, responses_b)


def position_debiased(first_better, prompts, responses_a, responses_b):
    """P(a is better than b) per prompt, asked in both orders and averaged: (n,). `first_better`
    (prompts, firsts, seconds) -> P(the response shown first is better) (n,).

    Order 1 shows a as "A"; order 2 shows b as "A", where a wins by the judge saying "B". A
    judge with a position bias adds it to one order and takes it from the other, so the mean
    cancels it: a judge that always says "A" gives exactly 0.5.
    """
    a_first = first_better(prompts, responses_a, responses_b)
    b_first = first_better(prompts, responses_b, responses_a)
    return (a_first + (1 - b_first)) / 2


# ============================================================================ the pairwise reward-model judge
@torch.no_grad()
def pairwise_first_better(model, tokenizer, prompts, firsts, seconds, batch_size=16, template=JUDGE_TEMPLATE):
    """A sequence classifier with one logit shown both responses (PairRM's use: the pair in one
    input): P(the first is better) = sigmoid(logit), read at the question's last token: (n,)."""
    texts = [judge_input(tokenizer, p, a, b, template) for p, a, b in zip(prompts, firsts, seconds)]
    probs = []
    for i in range(0, len(texts), batch_size):
        ids, mask = data.encode_prompts(tokenizer, texts[i:i + batch_size])  # left padded
        probs.append(torch.sigmoid(sampling.sequence_scores(model, ids.to(model.device), mask.to(model.device))).cpu())
    return torch.cat(probs).double().numpy()


# ============================================================================ the OpenAI-compatible HTTP judge
HTTP_WORKERS = 8  # requests in flight at once
MAX_REPLY_BYTES = 1 << 20  # a chat completion of one token is a few kB; a larger reply is refused unread


class JudgeUnreachable(Exception):
    """The HTTP judge gave no usable answer after every try (eval.main turns it into one sentence)."""


class JudgeBadAnswer(Exception):
    """The HTTP judge answered, but not with a verdict: the message names the answer (never retried:
    at temperature 0 the same question gets the same answer)."""


def _shown(response):
    return basics.brief(json.dumps(response, allow_nan=True), 200)


def answer_prob(response):
    """P(the first response is better) from a chat completion: from the answer token's top
    log-probs when the server gives both "A" and "B" among them, else from the answer, which must
    be exactly "A" (1) or "B" (0). Any other answer, a non-finite log-prob or a reply of another
    shape: JudgeBadAnswer naming it."""
    choices = response.get("choices") if isinstance(response, dict) else None
    choice = choices[0] if isinstance(choices, list) and choices else None
    if not isinstance(choice, dict):
        raise JudgeBadAnswer(f"the reply {_shown(response)} holds no choices[0] object")
    logprobs = choice.get("logprobs") or {}
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    tops = content[0].get("top_logprobs") if isinstance(content, list) and content and isinstance(content[0], dict) else None
    logps = {}
    for top in tops if isinstance(tops, list) else ():
        if not (isinstance(top, dict) and isinstance(top.get("token"), str) and type(top.get("logprob")) in (int, float)):
            raise JudgeBadAnswer(f"the reply's top_logprobs entry {_shown(top)} is not a token and a number")
        letter = top["token"].strip()
        if letter in ("A", "B"):
            if not np.isfinite(top["logprob"]):
                raise JudgeBadAnswer(f"the reply gives the verdict {letter!r} the log-prob {top['logprob']}, which is no "
                                     "probability")
            logps[letter] = np.logaddexp(logps.get(letter, -np.inf), top["logprob"])
    if len(logps) == 2:
        return float(1 / (1 + np.exp(logps["B"] - logps["A"])))
    message = choice.get("message")
    text = message.get("content") if isinstance(message, dict) else None
    if not isinstance(text, str) or text.strip() not in ("A", "B"):
        raise JudgeBadAnswer(f"the judge answered {basics.brief(repr(text), 120)}, which is not a verdict (exactly A or B)")
    return 1.0 if text.strip() == "A" else 0.0


class _Expired(Exception):
    pass


def post_json(url, body, headers, timeout, max_bytes=MAX_REPLY_BYTES):
    """POST `body` to `url` -> the parsed JSON reply: within `timeout` seconds in all (connection,
    headers and body: a server that sends one byte a second is cut off at the deadline), at most
    `max_bytes` of reply, and no redirect followed (the key would go wherever it points).
    Raises urllib.error.HTTPError for an error status, JudgeUnreachable for a redirect, OSError
    for a timeout or a broken connection, ValueError for a reply that is too large or not JSON."""
    import http.client
    import socket
    import threading
    import urllib.error
    import urllib.parse

    import urllib.request

    parts = urllib.parse.urlsplit(url)
    target = parts.path + (f"?{parts.query}" if parts.query else "")
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    proxy = urllib.request.getproxies().get(parts.scheme)  # HTTP(S)_PROXY, as urllib honours them
    if proxy and not urllib.request.proxy_bypass(parts.hostname or ""):
        via = urllib.parse.urlsplit(proxy if "://" in proxy else "http://" + proxy)
        login = {}  # http://user:password@proxy:port, as urllib sends it: basic Proxy-Authorization
        if via.username is not None:
            import base64

            pair = f"{urllib.parse.unquote(via.username)}:{urllib.parse.unquote(via.password or '')}"
            login = {"Proxy-Authorization": "Basic " + base64.b64encode(pair.encode()).decode("ascii")}
        if parts.scheme == "https":  # a CONNECT tunnel: the proxy never sees the key
            connection = kind(via.hostname, via.port or 80, timeout=timeout)
            connection.set_tunnel(parts.hostname, parts.port, headers=login)
        else:  # plain HTTP through a proxy: the absolute URL in the request line
            connection, target = http.client.HTTPConnection(via.hostname, via.port or 80, timeout=timeout), url
            headers = {**headers, **login}
    else:
        connection = kind(parts.hostname, parts.port, timeout=timeout)
    expired = threading.Event()
    held = []  # the socket, kept: the connection lets go of it once the reply's headers are read

    def expire():  # the deadline: a blocked read returns at once
        expired.set()
        for sock in held:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    timer = threading.Timer(timeout, expire)
    timer.start()
    try:
        connection.connect()
        held.append(connection.sock)
        if expired.is_set():  # the deadline passed while connecting
            expire()
        connection.request("POST", target, body, headers)
        reply = connection.getresponse()
        if 300 <= reply.status < 400:
            raise JudgeUnreachable(f"{url} redirected the request to {basics.brief(reply.getheader('Location', '?'), 120)}, "
                                   "which the judge does not follow (the API key would go there): pass the final URL as "
                                   "--judge_base_url")
        if reply.status >= 400:
            raise urllib.error.HTTPError(url, reply.status, reply.reason, reply.headers, None)
        data = reply.read(max_bytes + 1)
        if expired.is_set():  # the read ended at the deadline with part of the reply
            raise TimeoutError
        if len(data) > max_bytes:
            raise ValueError(f"the reply is larger than {max_bytes} bytes")
        return json.loads(data)
    except urllib.error.HTTPError:  # an error status, as it is (an OSError too, which the next clause would rename)
        raise
    except (OSError, http.client.HTTPException) as e:
        if expired.is_set():
            raise TimeoutError(f"no complete reply within {timeout:g} s") from None
        raise OSError(f"{type(e).__name__}: {basics.brief(e, 120)}") from None
    finally:
        timer.cancel()
        connection.close()


def http_first_better(model_name, args, template, prompts, firsts, seconds):
    """Ask an OpenAI-compatible /chat/completions endpoint, one request per question, HTTP_WORKERS
    at a time: P(the first is better) (n,). Each request has --judge_timeout seconds in all and is
    tried 1 + --judge_max_retries times (with 0.5, 1, 2, ... s between tries) unless the server
    refuses it for good (4xx) or redirects it; then JudgeUnreachable, and no request is left
    waiting. An answer that is not a verdict stops it at once (JudgeBadAnswer)."""
    import concurrent.futures
    import time
    import urllib.error
    import urllib.parse

    base = urllib.parse.urlsplit(args.judge_base_url)  # a query (Azure's ?api-version=) stays after the path
    url = base._replace(path=base.path.rstrip("/") + "/chat/completions").geturl()
    key = os.environ.get(args.judge_api_key_env, "") if args.judge_api_key_env else ""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}

    def ask(text):
        body = json.dumps({"model": model_name, "messages": [{"role": "user", "content": text}], "max_tokens": 1,
                           "temperature": 0.0, "logprobs": True, "top_logprobs": 5}).encode()
        for attempt in range(1 + args.judge_max_retries):
            if attempt:
                time.sleep(min(0.5 * 2 ** (attempt - 1), 8.0))
            try:
                response = post_json(url, body, headers, args.judge_timeout)
            except urllib.error.HTTPError as e:
                reason = f"HTTP {e.code} {e.reason}"
                if 400 <= e.code < 500 and e.code not in (408, 429):  # a bad request, key or model: trying again won't help
                    raise JudgeUnreachable(f"{url} refused the request ({reason})") from None
                continue
            except (OSError, ValueError) as e:  # timeout, refused, too large, not JSON
                reason = basics.brief(e, 160)
                continue
            return answer_prob(response)
        tries = 1 + args.judge_max_retries
        raise JudgeUnreachable(f"{url} gave no answer in {tries} {'try' if tries == 1 else 'tries'} ({reason})")

    texts = [fill_template(template, p, a, b) for p, a, b in zip(prompts, firsts, seconds)]
    pool = concurrent.futures.ThreadPoolExecutor(HTTP_WORKERS)
    try:
        return np.array([f.result() for f in [pool.submit(ask, t) for t in texts]])
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # after a failure: the queued questions are never asked
