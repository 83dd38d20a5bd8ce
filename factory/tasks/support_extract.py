"""The embedded extraction task: support message in, ``{"name","email","company","intent"}`` out.

Everything is a pure function of ``(n, seed)`` (one ``random.Random(seed)``, no clock), so the demo,
the tests and a rerun a month later see the same traffic. Each message is assembled from a
greeting, an intent-specific body, an optional company mention and a signature; the reference
answer is built from the same draws, so it is exactly right (the "frontier-quality" answer a
strong model would give), with ``null`` for a field the message does not contain.

Answers are compact JSON with the keys in the order ``name, email, company, intent``, the format
the system prompt asks for.
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any

from factory.tasks.sampling import choice, completion

INTENTS = ("refund", "bug_report", "billing_question", "cancel_subscription",
           "feature_request", "account_access", "shipping_status")
"""The labels ``intent`` takes."""

FIELDS = ("name", "email", "company", "intent")

SYSTEM_PROMPT = (
    "Extract the sender's details from the support message. Reply with one line of compact JSON "
    'with exactly the keys "name", "email", "company" and "intent", in that order. Use null for '
    "a name, email or company the message does not contain. intent is one of: "
    + ", ".join(INTENTS) + "."
)

REFERENCE_MODEL = "gpt-4o-2024-08-06"
"""The model name the generated records claim answered (the reference answers' author)."""

_FIRST = ("Maria", "James", "Aiko", "Lukas", "Priya", "Tom", "Sofia", "Omar", "Elena", "Daniel",
          "Chen", "Fatima", "Noah", "Grace", "Mateo", "Hannah", "Ivan", "Leila", "Samuel", "Yuki",
          "Olivia", "Ravi", "Clara", "Kwame", "Anna", "Diego", "Mei", "Jonas", "Amara", "Felix")
_LAST = ("Garcia", "Smith", "Tanaka", "Becker", "Sharma", "Nguyen", "Rossi", "Haddad", "Petrova",
         "Kim", "Okafor", "Larsen", "Dubois", "Silva", "Cohen", "Novak", "Murphy", "Alvarez",
         "Fischer", "Mensah", "Kowalski", "Ito", "Brown", "Moreau", "Singh")
_COMPANIES = ("Acme Logistics", "Brightleaf Studio", "Northwind Traders", "Globex", "Initech",
              "Bluefin Analytics", "Redwood Dental", "Solaris Energy", "Pinecrest Realty",
              "Vertex Robotics", "Harbor Coffee Co", "Lumen Health", "Quantum Bakery",
              "Orbit Media", "Cedar & Pine Law", "Atlas Freight", "Nimbus Labs", "Kestrel Bikes")
_FREE_MAIL = ("gmail.com", "outlook.com", "yahoo.com", "proton.me", "icloud.com")
_PRODUCTS = ("the mobile app", "the dashboard", "the invoice export", "the API", "the desktop app",
             "the checkout page", "the reporting tool", "the calendar sync")

_BODIES: dict[str, tuple[str, ...]] = {
    "refund": (
        "I was charged twice for order #{num} and would like my money back for the duplicate.",
        "The blender I received on {day} arrived broken. Please refund the {amount} I paid.",
        "I returned the package last week but still haven't seen the refund of {amount}.",
        "Could you refund my last payment? I cancelled before the renewal date.",
    ),
    "bug_report": (
        "{product} crashes every time I try to upload a file larger than 10 MB.",
        "Since the update on {day}, {product} shows a blank screen after login.",
        "The totals in {product} are wrong: it adds tax twice on every line.",
        "Clicking save in {product} does nothing, and the console shows error {num}.",
    ),
    "billing_question": (
        "Why did my invoice go up to {amount} this month? I didn't change plans.",
        "Can you explain the extra line item on invoice #{num}?",
        "Do you offer annual billing, and would it lower the {amount} we pay monthly?",
        "Which card is on file for our account? I need to update it before {day}.",
    ),
    "cancel_subscription": (
        "Please cancel our subscription at the end of the current billing period.",
        "We no longer need the service. How do I cancel before the renewal on {day}?",
        "I want to close my account and stop all future charges.",
        "Cancel my plan please, we moved to a different tool.",
    ),
    "feature_request": (
        "It would be great if {product} could export to CSV.",
        "Any plans to add dark mode to {product}? Our team works late.",
        "We'd love single sign-on with Google for {product}.",
        "Could you add a way to schedule reports weekly in {product}?",
    ),
    "account_access": (
        "I can't log in: the password reset email never arrives.",
        "My account got locked after too many attempts. Can you unlock it?",
        "Two-factor codes from the app are rejected since I changed phones.",
        "I lost access to the email on my account. How can I recover it?",
    ),
    "shipping_status": (
        "Where is my order #{num}? The tracking hasn't updated since {day}.",
        "My package was supposed to arrive on {day} but it still says in transit.",
        "Can you tell me when order #{num} will ship?",
        "The courier says delivered, but order #{num} never reached us.",
    ),
}
_GREETINGS = ("Hi,", "Hello,", "Hi there,", "Dear support team,", "Hey,", "Good morning,", "")
_DAYS = ("Monday", "Tuesday", "March 3", "May 14", "June 2", "last Friday", "the 21st")




def _slug(text: str) -> str:
    return "".join(c for c in text.lower() if c.isalnum())


def _one(rng: random.Random) -> tuple[str, dict[str, Any]]:
    """One support message and its exact extraction."""
    first, last = choice(rng, _FIRST), choice(rng, _LAST)
    intent = choice(rng, INTENTS)
    has_name = rng.random() < 0.9
    has_company = rng.random() < 0.65
    has_email = rng.random() < 0.85
    company = choice(rng, _COMPANIES) if has_company else None
    if company is not None and rng.random() < 0.7:
        domain = _slug(company.split()[0]) + choice(rng, (".com", ".io", ".co"))
    else:
        domain = choice(rng, _FREE_MAIL)
    local = choice(rng, (f"{first}.{last}", f"{first[0]}{last}", f"{first}", f"{first}{last[0]}"))
    email = f"{local.lower()}@{domain}" if has_email else None
    body = choice(rng, _BODIES[intent]).format(
        num=rng.randrange(10000, 99999), day=choice(rng, _DAYS),
        amount=f"${rng.randrange(9, 400)}.{rng.randrange(100):02d}",
        product=choice(rng, _PRODUCTS))
    body = body[0].upper() + body[1:]
    lines = []
    greeting = choice(rng, _GREETINGS)
    if greeting:
        lines.append(greeting)
    intro = ""
    if company is not None and rng.random() < 0.5:
        intro = choice(rng, (f"I work at {company}. ", f"We're a customer from {company}. ",
                              f"Writing on behalf of {company}. "))
        company_in_sig = False
    else:
        company_in_sig = company is not None
    lines.append(intro + body)
    if email is not None and rng.random() < 0.35:
        lines.append(f"You can reach me at {email}.")
        email_in_sig = False
    else:
        email_in_sig = email is not None
    sig = []
    if has_name:
        sig.append(choice(rng, ("Thanks,", "Best,", "Regards,", "Cheers,", "Thank you,"))
                   + "\n" + (f"{first} {last}" if rng.random() < 0.8 else first))
        name: str | None = sig[-1].split("\n", 1)[1]
    else:
        sig.append(choice(rng, ("Thanks", "Regards", "Thank you")))
        name = None
    if company_in_sig:
        sig.append(company)  # type: ignore[arg-type]
    if email_in_sig:
        sig.append(email)  # type: ignore[arg-type]
    message = "\n".join(lines) + "\n\n" + "\n".join(sig)
    answer = {"name": name, "email": email, "company": company, "intent": intent}
    return message, answer


def reference_answer(answer: dict[str, Any]) -> str:
    """The compact JSON text of an extraction (keys in the order the prompt asks for)."""
    return json.dumps({k: answer[k] for k in FIELDS}, ensure_ascii=False, separators=(",", ":"))


def generate_conversations(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` conversations ``{"messages": [system, user, assistant]}`` (OpenAI message format,
    string content), the assistant turn being the reference answer."""
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n: must be an integer >= 0, got {n!r}")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        message, answer = _one(rng)
        out.append({"messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": message},
            {"role": "assistant", "content": reference_answer(answer)},
        ]})
    return out


def generate_records(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` logged calls as OpenAI ``{"request": chat.completions body, "response": completion}``
    records: send ``request`` through the gateway, or upload the records as a JSONL file."""
    records = []
    for i, conv in enumerate(generate_conversations(n, seed)):
        request = {"model": REFERENCE_MODEL, "messages": conv["messages"][:2], "temperature": 0}
        content = conv["messages"][2]["content"]
        digest = hashlib.sha256(f"{seed}:{i}:{content}".encode()).hexdigest()[:24]
        prompt_words = sum(len(m["content"].split()) for m in request["messages"])
        response = completion(content, model=REFERENCE_MODEL, index=i, digest=digest,
                              prompt_tokens=int(prompt_words * 1.3) + 8,
                              completion_tokens=len(content) // 3 + 1)
        records.append({"request": request, "response": response})
    return records


def field_accuracy(output: str, reference: str) -> float:
    """Share of the four fields ``output`` gets exactly right (0 when it is not a JSON object):
    the task's own metric, independent of any rubric, for reporting margins."""
    try:
        got = json.loads(output.strip())
    except json.JSONDecodeError:
        return 0.0
    want = json.loads(reference)
    if not isinstance(got, dict):
        return 0.0
    return sum(got.get(k) == want[k] for k in FIELDS) / len(FIELDS)
