"""The triage task: route a support ticket to exactly one of five teams, answered by its label.

A generated 5-way classification task for the loop benchmark (``bench/loop.py``). The shop,
Brightdesk, sells motorised standing desks and the app that drives them, so tickets are about
money (``billing``), something broken in the app or the desk (``bug``), signing in
(``account_access``), deliveries (``shipping``) or wishes (``feature_request``). The reference
answer is the label alone, the system prompt names the five labels and asks for the label only,
and ``exact_label`` scores an answer: stripped and lower-cased, it equals the label.

Everything is a pure function of ``(n, seed)`` (one ``random.Random(seed)``, no clock). Labels
follow a shuffled schedule with equal shares (a batch of 500 holds 100 of each). A ticket is
assembled from parts:

- a *core* frame (the request itself; its ``template``), filled from shared slot vocabularies
  (order numbers, amounts, plans, screens of the app, devices, carriers, cities, wishes);
- in about 30% of the tickets only that (``short``); otherwise with a greeting and a sign-off
  (``medium``) or also a *detail* sentence of the same team (``long``);
- an *aside* names another team's words as a distractor ("The app itself works fine, no bugs."
  in a billing ticket), in most long tickets and some medium ones;
- surface noise: a long ticket may put its sentences on separate lines; 15% of the tickets are
  all lower case without final punctuation, 3% all upper case, 20% carry a one-letter typo.

Cores, details and asides come in two disjoint sets (``TEMPLATES["train"]`` and
``TEMPLATES["heldout"]``); greetings and sign-offs are shared. Two held-out sets score a model:
``generate_heldout`` phrases its tickets with the held-out frames only (phrasings the traffic
never used: how far the model generalizes), ``generate_unseen`` draws fresh tickets of the
traffic's own frames and keeps only those that are neither a training ticket nor a
near-duplicate of one (more traffic of the same kind: what the deployment will be sent).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping
from typing import Any

from factory.curation.config import CurationConfig
from factory.curation.neardup import flat_words, ngram_hashes
from factory.tasks.sampling import capitalized, choice, completion, schedule

TAGS = {"project": "ticket-triage"}
"""Tags the bench ingests the records with."""

WHERE = "tags['project'] = 'ticket-triage'"
"""The ``data.where`` of an experiment on these records (it selects ``TAGS``)."""

REFERENCE_MODEL = "gpt-4o-mini-2024-07-18"
"""The model name the generated records claim answered (the reference answers' author)."""

LABELS = ("billing", "bug", "account_access", "shipping", "feature_request")
"""The five teams, each a single lower-case token; the answer is exactly one of them."""

SYSTEM_PROMPT = (
    "You triage support tickets for Brightdesk (standing desks and the Brightdesk app). Route "
    "the ticket to one team: billing, bug, account_access, shipping or feature_request. "
    "Answer with the label only."
)

STYLE_SHARES = {"short": 0.3, "medium": 0.35, "long": 0.35}
"""Ticket lengths: the core only; greeting, core, sign-off (an aside in 25%); greeting, core,
detail, sign-off (an aside in 75%). Trainer tokens of 500 tickets with the system prompt: 73 to
126, median 91 (51 of them the system prompt)."""

# ---------------------------------------------------------------------------------------------
# Slot vocabularies (shared by both splits).

_PLANS = ("Pro plan", "Team plan", "Basic plan", "annual subscription", "Business plan")
_SCREENS = ("the calendar view", "the height presets screen", "the reports page",
            "the focus timer", "the team dashboard", "the sitting-time chart",
            "the Outlook sync", "the desk pairing screen", "the weekly planner",
            "the settings page")
_DEVICES = ("my iPhone", "a Pixel 8", "my Windows laptop", "Chrome", "Firefox", "Safari",
            "my iPad", "a Galaxy tablet", "my MacBook")
_CARRIERS = ("UPS", "DHL", "FedEx", "DPD", "the courier")
_CITIES = ("Leeds", "Lyon", "Denver", "Rotterdam", "Graz", "Austin", "Porto", "Malmo", "Cork",
           "Turin")
_COUNTRIES = ("Norway", "Switzerland", "Canada", "Iceland", "Israel", "Japan")
_WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August",
           "September", "October", "November", "December")
_ERRORS = ("error 500", "error E-42", "a blank white screen", "'Something went wrong'",
           "error code 0x1F", "a timeout error")
_WISHES = ("a dark mode", "export to PDF", "keyboard shortcuts", "a Linux app",
           "recurring tasks", "a Slack integration", "a public API", "a weekly summary email",
           "more height presets", "shared team calendars", "two-way sync with Outlook",
           "an Apple Watch app")
_NAMES = ("Maria", "James", "Aiko", "Lukas", "Priya", "Tom", "Sofia", "Omar", "Elena",
          "Daniel", "Chen", "Fatima", "Noah", "Grace", "Mateo", "Hannah", "Ivan", "Leila",
          "Jonas", "Clara")
_MAIL_DOMAINS = ("gmail.com", "outlook.com", "proton.me", "fastmail.com", "icloud.com")

GREETINGS = ("Hi,", "Hello,", "Hi team,", "Hey there,", "Dear support,", "Good morning,",
             "Hello Brightdesk,", "Hi all,")
SIGNOFFS = ("Thanks.", "Thanks, {name}", "Regards, {name}", "- {name}", "Cheers, {name}",
            "Thank you!", "Best, {name}")

# ---------------------------------------------------------------------------------------------
# Frames: split -> part -> label -> frames. A core is the request, a detail adds context of the
# same team, an aside mentions another team's words (a distractor).

_TRAIN_CORES: dict[str, tuple[str, ...]] = {
    "billing": (
        "I was charged twice for my {plan} this month.",
        "Why is there a charge of {amount} on my card? I never upgraded.",
        "Can you send me an invoice for order {order}? Our accounting needs it.",
        "Please cancel my {plan} renewal before I get billed again.",
        "The invoice for {month} shows {amount} but we agreed on a lower price.",
        "I'd like a refund of {amount} for the {plan}, I only used it for {days} days.",
        "How do I change the credit card you bill every month for the {plan}?",
        "my card got declined when renewing the {plan}, can you retry the payment",
        "We need our VAT number added to the invoice for order {order}.",
        "You took {amount} from my account on {weekday} and I don't know what it's for.",
        "Is there a discount if we switch the {plan} to yearly billing?",
        "The promo code didn't apply and I paid full price, {amount}.",
        "Downgraded to the free tier in {month} but still being charged {amount}.",
        "Charged in dollars instead of euros on order {order}, please fix the currency.",
        "The receipt for {amount} is missing from my billing history.",
        "Who do I talk to about a double payment on order {order}?",
    ),
    "bug": (
        "{screen} crashes every time I open it on {device}.",
        "When I click save in {screen} I get {error}.",
        "{screen} has been broken since the last update.",
        "The desk ignores the height presets I set in the app on {device}.",
        "Nothing loads in {screen}, just a spinner forever on {device}.",
        "the app freezes when i try to open {screen}",
        "Getting {error} whenever I open {screen}.",
        "{screen} shows yesterday's numbers instead of today's, even after a refresh.",
        "Notifications stopped working on {device} after the update.",
        "The desk lowers itself after a few minutes, around {days} times a day now.",
        "Exporting from {screen} produces an empty file.",
        "Dark mode makes the text in {screen} invisible on {device}.",
        "I keep seeing {error} on {device}, reinstalling didn't help.",
        "Buttons in {screen} do nothing when I tap them.",
        "Times are off by one hour in {screen} since the clocks changed.",
        "The app closes as soon as I connect the desk over Bluetooth from {device}.",
    ),
    "account_access": (
        "I can't log in to my account since {weekday}.",
        "The password reset email never arrives at {email}.",
        "My account {email} is locked after too many attempts, please unlock it.",
        "I lost {device} and can't get past two-factor authentication.",
        "It says {email} is not registered, but I've used it for years.",
        "How do I change the email I sign in with? It is still {email}.",
        "the login code you text me never comes, tried {days} times",
        "I'm stuck on the sign-in page on {device}, it just reloads.",
        "Someone changed my password on {weekday} and I can't get into my account anymore.",
        "Our admin left the company and nobody can access the team account since {month}.",
        "Can you merge my two accounts? I signed up twice with {email} and a work address.",
        "The verification link in the signup email to {email} has expired.",
        "Single sign-on with our company Google account stopped letting me in on {weekday}.",
        "I forgot which email I signed up with in {month}, can you help me get back in?",
        "After changing my password on {device} I got logged out everywhere and can't log "
        "back in.",
    ),
    "shipping": (
        "Where is my desk? Order {order} was supposed to arrive {days} days ago.",
        "The tracking number for order {order} doesn't work on the {carrier} site.",
        "{carrier} says delivered but nothing came to my door in {city}.",
        "Can you ship order {order} to my office in {city} instead?",
        "The box for order {order} arrived damaged and the desk top is scratched.",
        "How long does delivery to {city} usually take?",
        "I only received one of the two packages for order {order}.",
        "my order {order} has been stuck in {city} for a week",
        "Can I pick a delivery date for order {order}? Nobody is home on {weekday}.",
        "Do you ship to {country}? I want to order a desk.",
        "{carrier} left the package outside in the rain on {weekday}.",
        "Order {order} still says 'preparing' after {days} days.",
        "The wrong desk frame arrived with order {order}, I ordered the black one.",
        "Is express delivery available for order {order}?",
        "{carrier} wants a customs fee before handing over order {order}, is that right?",
    ),
    "feature_request": (
        "It would be great if {screen} had {wish}.",
        "Please add {wish}, we really need it.",
        "Any plans to support {wish}?",
        "Could you make the desk remember more than four presets? Also {wish} would help.",
        "I'd love {wish} in the next version.",
        "Suggestion: let us choose the first day of the week in {screen}.",
        "Our team would pay extra for {wish}.",
        "why is there no {wish} yet? every other app has it",
        "Would you consider {wish} for {device}?",
        "Idea: a reminder in {screen} to stand up every hour.",
        "Can {screen} get a search box? Scrolling takes forever.",
        "Please make {screen} available offline.",
        "We'd like {wish} so we can connect our own tools.",
        "Is there a way to vote for {wish} on your roadmap?",
        "Wish list: {wish}, and bigger fonts in {screen}.",
    ),
}

_HELDOUT_CORES: dict[str, tuple[str, ...]] = {
    "billing": (
        "Our finance team spotted {amount} on the statement that nobody approved.",
        "Money left my account twice for the same {plan}. Please give one back.",
        "I need a proper tax receipt for order {order}.",
        "Stop renewing my {plan} automatically, I don't want to pay for another year.",
        "Could you update the company address that appears on our invoices from {month} on?",
        "The price went up to {amount} without any notice. Why?",
        "Paid {amount} by PayPal on {weekday} but my account still says payment due.",
        "Want to switch from monthly to annual payment on the {plan}.",
    ),
    "bug": (
        "{screen} is acting weird: half the screen stays blank on {device}.",
        "Something is wrong with {screen}. It throws {error} on every attempt.",
        "Since version 4.2, {screen} won't open anymore on {device}.",
        "Pressing the up button on the desk does nothing, but the app says it's moving.",
        "{screen} duplicates every entry I create.",
        "Your latest release broke {screen} for us on {device}.",
        "Charts in {screen} render upside down, seriously.",
        "The app hangs for a minute and then shows {error}.",
    ),
    "account_access": (
        "Locked out again. The reset link you sent to {email} says it's invalid.",
        "I need access to my profile but the authenticator app was on {device}, which broke.",
        "Please remove the second factor from my account, I can't receive the codes.",
        "Your site keeps telling me wrong password even though I just set it on {weekday}.",
        "Can't get into the workspace since {email} was renamed by our IT.",
        "My username was taken over, I think I was hacked. Help me recover {email}.",
        "The invite link from my colleague says my account is disabled.",
        "Signing in with Apple just loops back to the start screen on {device}.",
    ),
    "shipping": (
        "Still waiting on the parcel for {order}, {carrier} has no updates.",
        "Delivery to {city} keeps getting postponed.",
        "The package for {order} went to my old address, please redirect it to {city}.",
        "Half of the desk parts are missing from the box of order {order}.",
        "How soon can a desk reach {city} if I order today?",
        "{carrier} returned order {order} to you, can you send it again?",
        "My tracking page hasn't moved since {weekday}.",
        "The courier wants me to collect the desk from a depot in {city}, I can't carry it.",
    ),
    "feature_request": (
        "Hoping you'll build {wish} at some point.",
        "{screen} is nice, but what it really lacks is {wish}.",
        "Request from our office: {wish}, please.",
        "Would it be possible to have {wish}? It would save us hours.",
        "Add a setting to hide finished tasks in {screen}.",
        "Put {wish} on the roadmap, please.",
        "Are you going to offer {wish} anytime soon?",
        "Missing feature: {wish}. Would make the app perfect.",
    ),
}

_TRAIN_DETAILS: dict[str, tuple[str, ...]] = {
    "billing": ("Our customer number is {order}.", "This is the second time it happened.",
                "Please fix this before the next billing date.",
                "I've attached a screenshot of the bank statement."),
    "bug": ("I'm on {device}.", "I already tried logging out and back in.",
            "It worked fine last month.", "Steps: open the app, go to {screen}, wait."),
    "account_access": ("My username is {email}.", "I've tried three different browsers.",
                       "I really need my data for a meeting on {weekday}."),
    "shipping": ("The tracking page says it left the warehouse on {weekday}.",
                 "I need it before {weekday}.", "I live in {city}."),
    "feature_request": ("Many people in our office would use it.", "Thanks for considering!",
                        "It's the only thing I miss."),
}

_HELDOUT_DETAILS: dict[str, tuple[str, ...]] = {
    "billing": ("The statement is dated {weekday}.", "Accounting closes the books soon."),
    "bug": ("Happens on {device} too.", "Cleared the cache, no change."),
    "account_access": ("This is urgent, my whole team is waiting.",
                       "Contact me at {email} please."),
    "shipping": ("We moved to {city} last month.", "It's a gift, so timing matters."),
    "feature_request": ("Just an idea, no rush.", "Keep up the good work."),
}

_TRAIN_ASIDES: dict[str, tuple[str, ...]] = {
    "billing": ("The app itself works fine, no bugs.", "The desk arrived on time.",
                "Logging in is not a problem.", "I'm not asking for a new feature."),
    "bug": ("My subscription is paid and up to date.", "The desk was delivered last week.",
            "I can still log in to my account."),
    "account_access": ("I've paid for the {plan} already.", "My last order shipped fine.",
                       "There is no bug as far as I can tell."),
    "shipping": ("The invoice is already paid.", "The app shows the order fine, no bug there.",
                 "My account works."),
    "feature_request": ("Everything works, this is not a bug report.",
                        "Happy to pay for it.", "Delivery and billing were smooth."),
}

_HELDOUT_ASIDES: dict[str, tuple[str, ...]] = {
    "billing": ("Delivery was quick, no complaints there.", "I can sign in fine."),
    "bug": ("Billing is all in order.", "Shipping was fast."),
    "account_access": ("My invoice is paid.", "I'm not reporting a crash."),
    "shipping": ("Payment went through fine.", "I could log in and see the order."),
    "feature_request": ("Not a complaint, the app runs fine.", "No problem with my account."),
}

TEMPLATES: dict[str, dict[str, dict[str, tuple[str, ...]]]] = {
    "train": {"core": _TRAIN_CORES, "detail": _TRAIN_DETAILS, "aside": _TRAIN_ASIDES},
    "heldout": {"core": _HELDOUT_CORES, "detail": _HELDOUT_DETAILS, "aside": _HELDOUT_ASIDES},
}
"""split (``train``/``heldout``) -> part (``core``/``detail``/``aside``) -> label -> frames."""

# ---------------------------------------------------------------------------------------------
# Assembly.


def _slots(rng: random.Random) -> dict[str, str]:
    """One draw of every slot (all of them, every time, so the stream of draws does not depend
    on which frame is chosen)."""
    name = choice(rng, _NAMES)
    cents = rng.randrange(9, 400) * 100 + choice(rng, (0, 0, 0, 99, 50))
    currency = choice(rng, ("$", "€", "£"))
    return {
        "order": f"BD-{rng.randrange(10000, 100000)}",
        "amount": f"{currency}{cents // 100}.{cents % 100:02d}",
        "plan": choice(rng, _PLANS), "screen": choice(rng, _SCREENS),
        "device": choice(rng, _DEVICES), "carrier": choice(rng, _CARRIERS),
        "city": choice(rng, _CITIES), "country": choice(rng, _COUNTRIES),
        "weekday": choice(rng, _WEEKDAYS), "month": choice(rng, _MONTHS),
        "error": choice(rng, _ERRORS), "wish": choice(rng, _WISHES),
        "days": str(rng.randrange(2, 21)), "name": name,
        "email": f"{name.lower()}{rng.randrange(1, 100)}@{choice(rng, _MAIL_DOMAINS)}",
    }


def _fill(frame: str, slots: Mapping[str, str]) -> str:
    """The frame filled; a frame that starts with a slot gets a capital first letter."""
    text = frame.format(**slots)
    return capitalized(text) if frame.startswith("{") else text


def _typo(rng: random.Random, text: str) -> str:
    """One slip of the keyboard in one word of at least five letters: two letters swapped, one
    dropped or one doubled."""
    words = text.split(" ")
    candidates = [i for i, w in enumerate(words) if len(w) >= 5 and w.isalpha()]
    if not candidates:
        return text
    i = choice(rng, tuple(candidates))
    w = words[i]
    j = rng.randrange(1, len(w) - 1)
    kind = rng.randrange(3)
    if kind == 0:
        w = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    elif kind == 1:
        w = w[:j] + w[j + 1:]
    else:
        w = w[:j] + w[j] + w[j:]
    words[i] = w
    return " ".join(words)


def _style(rng: random.Random) -> str:
    """A ticket's length, drawn in ``STYLE_SHARES`` (per ticket, not scheduled: only the labels
    need exact shares)."""
    x = rng.random()
    if x < STYLE_SHARES["short"]:
        return "short"
    return "medium" if x < STYLE_SHARES["short"] + STYLE_SHARES["medium"] else "long"


def _frames(held: tuple[str, ...]) -> dict[str, dict[str, tuple[str, ...]]]:
    """Frames of each part: ``TEMPLATES["heldout"]``'s for the parts in ``held``, the training
    ones for the rest."""
    unknown = set(held) - set(TEMPLATES["train"])
    if unknown:
        raise ValueError(f"held: unknown parts {sorted(unknown)}; the parts are "
                         f"{', '.join(TEMPLATES['train'])}")
    return {part: TEMPLATES["heldout" if part in held else "train"][part]
            for part in TEMPLATES["train"]}


def _ticket(rng: random.Random, label: str, frames: Mapping[str, Mapping[str, Any]]
            ) -> dict[str, Any]:
    """One ticket of ``label`` from ``frames`` (part -> label -> frames, as a ``TEMPLATES``
    entry): its text, the frames it used, the clean text of its core and its style."""
    slots = _slots(rng)
    style = _style(rng)
    core_frame = choice(rng, frames["core"][label])
    core = _fill(core_frame, slots)
    parts = [core]
    used = {"core": core_frame}
    aside_p = {"short": 0.0, "medium": 0.25, "long": 0.75}[style]
    if style == "long":
        detail_frame = choice(rng, frames["detail"][label])
        used["detail"] = detail_frame
        parts.append(_fill(detail_frame, slots))
    if rng.random() < aside_p:
        aside_frame = choice(rng, frames["aside"][label])
        used["aside"] = aside_frame
        aside = _fill(aside_frame, slots)
        if rng.random() < 0.5:
            parts.insert(0, aside)
        else:
            parts.append(aside)
    if style != "short":
        parts.insert(0, choice(rng, GREETINGS))
        parts.append(_fill(choice(rng, SIGNOFFS), slots))
    sep = "\n" if style == "long" and rng.random() < 0.4 else " "
    text = sep.join(parts)
    noise = rng.random()
    if noise < 0.15:
        text = text.lower().rstrip(".!?")
        noise_kind = "lower"
    elif noise < 0.18:
        text = text.upper()
        noise_kind = "upper"
    else:
        noise_kind = "none"
    if rng.random() < 0.2:
        text = _typo(rng, text)
        noise_kind += "+typo"
    return {"text": text, "core": core, "template": core_frame, "frames": used,
            "style": style, "noise": noise_kind}


def _check_n(n: Any) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"n: must be an integer >= 0, got {n!r}")


def _tickets(n: int, seed: int, frames: Mapping[str, Mapping[str, Any]]
             ) -> list[dict[str, Any]]:
    _check_n(n)
    rng = random.Random(seed)
    labels = schedule(rng, n, {label: 1 / len(LABELS) for label in LABELS})
    out = []
    for label in labels:
        ticket = _ticket(rng, label, frames)
        out.append({"messages": [{"role": "system", "content": SYSTEM_PROMPT},
                                 {"role": "user", "content": ticket.pop("text")}],
                    "label": label, **ticket})
    return out


def generate_conversations(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` training conversations in equal label shares: ``{"messages"`` (system, user, and
    the reference assistant turn: the label), ``"label"``, ``"template"`` (the core frame),
    ``"core"`` (the core's text before noise), ``"frames"`` (part -> frame used), ``"style"``
    (short/medium/long), ``"noise"``\\ ``}``."""
    convs = _tickets(n, seed, TEMPLATES["train"])
    for conv in convs:
        conv["messages"].append({"role": "assistant", "content": conv["label"]})
    return convs


def generate_records(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` logged calls as OpenAI ``{"request": chat.completions body, "response": completion}``
    records: upload them as a JSONL file with ``factory ingest FILE --tag project=ticket-triage``,
    or send ``request`` through the gateway."""
    records = []
    for i, conv in enumerate(generate_conversations(n, seed)):
        *prompt, reply = conv["messages"]
        request = {"model": REFERENCE_MODEL, "messages": prompt, "temperature": 0,
                   "max_tokens": 8}
        digest = hashlib.sha256(f"{seed}:{i}:{reply['content']}".encode()).hexdigest()[:24]
        prompt_chars = sum(len(m["content"]) for m in prompt)
        response = completion(reply["content"], model=REFERENCE_MODEL, index=i, digest=digest,
                              prompt_tokens=prompt_chars // 4 + 8, completion_tokens=2)
        records.append({"request": request, "response": response})
    return records


def generate_heldout(n: int, seed: int = 0,
                     held: tuple[str, ...] = ("core", "detail", "aside")) -> list[dict[str, Any]]:
    """``n`` held-out tickets in equal label shares, phrased with ``TEMPLATES["heldout"]`` frames
    for the parts in ``held`` (by default every part: the disjoint set) and the training frames
    for the others: ``{"messages"`` (system + user), ``"label"`` (the expected answer),
    ``"template"``, ``"core"``, ``"frames"``, ``"style"``, ``"noise"``\\ ``}``.

    ``held=("core",)`` gives *new requests*: every ticket asks with a core frame the traffic
    never used, inside the detail and aside sentences the traffic has (new phrasings of the
    same traffic). The disjoint set also changes those sentences, so no hold-out of the traffic
    can show it: a memorizing classifier scores 0.79 on the phrasing split's eval set, 0.78 on
    new requests and 0.55 on the disjoint set, means over five traffic seeds
    (``tests/curation/test_phrasing.py``)."""
    return _tickets(n, seed, _frames(held))


def _user_text(conv: Mapping[str, Any]) -> str:
    return next(str(m["content"]) for m in conv["messages"] if m["role"] == "user")


def generate_unseen(n: int, seed: int, training: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``n`` held-out tickets in equal label shares, phrased with the training frames
    (``TEMPLATES["train"]``: fresh slot fills, greetings, details, asides and noise), none of
    them a near-duplicate of a ``training`` conversation's ticket (as ``generate_conversations``
    returns them) by curation's own test (``CurationConfig``'s default ``near_dup_threshold``
    on word ``shingle_words``-grams, measured on the ticket alone), nor the text of another of
    the ``n``. Each is a ``generate_heldout`` ticket plus ``"nearest"``: its highest Jaccard
    with a training ticket."""
    _check_n(n)
    config = CurationConfig()

    def shingles(texts: list[str]) -> list[set[int]]:
        values, offsets = ngram_hashes(*flat_words(texts), config.shingle_words)
        return [set(values[offsets[i]:offsets[i + 1]].tolist()) for i in range(len(texts))]

    seen = shingles([_user_text(c) for c in training])
    by_shingle: dict[int, list[int]] = {}
    for i, sh in enumerate(seen):
        for g in sh:
            by_shingle.setdefault(g, []).append(i)

    def nearest(sh: set[int]) -> float:
        shared: dict[int, int] = {}
        for g in sh:
            for i in by_shingle.get(g, ()):
                shared[i] = shared.get(i, 0) + 1
        return max((k / (len(sh) + len(seen[i]) - k) for i, k in shared.items()), default=0.0)

    rng = random.Random(seed)
    labels = schedule(rng, n, {label: 1 / len(LABELS) for label in LABELS})
    texts: set[str] = set()
    out = []
    for label in labels:
        for _ in range(1000):
            ticket = _ticket(rng, label, TEMPLATES["train"])
            near = nearest(shingles([ticket["text"]])[0])
            if near < config.near_dup_threshold and ticket["text"] not in texts:
                break
        else:
            raise ValueError(f"no {label} ticket unlike every training ticket in 1000 draws")
        texts.add(ticket["text"])
        out.append({"messages": [{"role": "system", "content": SYSTEM_PROMPT},
                                 {"role": "user", "content": ticket.pop("text")}],
                    "label": label, **ticket, "nearest": round(near, 3)})
    return out


def exact_label(label: str, answer: str | None) -> bool:
    """Whether ``answer`` (an assistant message's content), stripped of surrounding whitespace
    and lower-cased, is exactly ``label``."""
    return isinstance(answer, str) and answer.strip().lower() == label
