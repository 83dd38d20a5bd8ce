"""The embedded agent task: an online shop's order-support agent with four function tools.

Everything is a pure function of ``(n, seed)`` (one ``random.Random(seed)``, no clock). A
conversation is one of three kinds, in fixed shares of every batch (a shuffled schedule, not
independent draws, so a batch of 200 holds the shares exactly):

- ``call`` (58%): a request that needs a tool, answered with one tool call;
- ``result`` (20%): the same request, the tool call, the tool's result, answered in text;
- ``none`` (22%): a question the system prompt's facts answer (returns, shipping, payment) or
  a greeting or thanks, answered in text with no tool.

Requests are in English (64%), Spanish, German or French (12% each), and every answer is in
the request's language. Each request is a template (a sentence frame) filled with slots (order
number, item, reason phrase, address, amount); the references are built from the same draws, so
they are exactly right. Tools have an enum argument (``cancel_order.reason``,
``issue_refund.reason``) and a nested object (``update_shipping_address.address`` with an enum
``country``); the user names the country in their own language and writes amounts as
``€24.50`` (English) or ``24,50 €``, and the call carries the ISO code and the number.

``generate_heldout`` phrases its requests with a disjoint set of frames (``TEMPLATES["heldout"]``;
the slot vocabularies are shared), each with the exact expected call, for ``exact_tool_call``.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Mapping
from typing import Any

from factory.evals.rubric import json_equal
from factory.tasks.sampling import capitalized, choice, schedule

TAGS = {"project": "agent-orders"}
"""Tags the bench ingests the records with; ``experiments/agent-orders.yaml`` selects them."""

REFERENCE_MODEL = "gpt-4o-2024-08-06"
"""The model name the generated records claim answered (the reference answers' author)."""

LANGUAGES = ("en", "es", "de", "fr")
CANCEL_REASONS = ("ordered_by_mistake", "found_cheaper", "too_slow", "changed_mind")
REFUND_REASONS = ("damaged", "wrong_item", "missing_parts", "late_delivery")
COUNTRIES = ("DE", "AT", "FR", "ES", "IT", "NL")
TOOL_NAMES = ("get_order_status", "cancel_order", "update_shipping_address", "issue_refund")
TOPICS = ("returns", "shipping", "payment", "greeting", "thanks")
"""Requests that need no tool."""

KIND_SHARES = {"call": 0.58, "result": 0.20, "none": 0.22}
LANGUAGE_SHARES = {"en": 0.64, "es": 0.12, "de": 0.12, "fr": 0.12}
HELDOUT_KIND_SHARES = {"call": 0.78, "none": 0.22}
"""Held-out requests are single turns: a tool call or no tool."""

SYSTEM_PROMPT = (
    "You are the support agent of Nordpak, an online shop. Use a tool when the request needs "
    "one; otherwise answer briefly in the customer's language. Facts: returns within 30 days "
    "of delivery; shipping is free from 50 EUR, else 4.90 EUR; we accept Visa, Mastercard, "
    "PayPal and Klarna."
)


def _fn(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties,
                       "required": list(properties)}}}


_STR = {"type": "string"}
TOOLS: list[dict[str, Any]] = [
    _fn("get_order_status", "Status and delivery date of an order.", {"order_id": _STR}),
    _fn("cancel_order", "Cancel an order.",
        {"order_id": _STR, "reason": {"type": "string", "enum": list(CANCEL_REASONS)}}),
    _fn("update_shipping_address", "Change an order's delivery address.", {
        "order_id": _STR,
        "address": {"type": "object", "properties": {
            "street": _STR, "city": _STR, "postal_code": _STR,
            "country": {"type": "string", "enum": list(COUNTRIES)}},
            "required": ["street", "city", "postal_code", "country"]}}),
    _fn("issue_refund", "Refund part or all of an order.", {
        "order_id": _STR, "amount": {"type": "number", "description": "EUR"},
        "reason": {"type": "string", "enum": list(REFUND_REASONS)}}),
]
"""OpenAI ``tools`` (function tools) of every request; kept short because SmolLM2 reads them
in every sample (the rendered tools block is most of a sample's tokens)."""

# ---------------------------------------------------------------------------------------------
# Slot vocabularies. Items are singular nouns with their article; ``fem`` drives the few
# agreements (Spanish -o/-a, French -e) the frames need.

_ITEMS: dict[str, tuple[tuple[str, bool], ...]] = {
    "en": (("the desk lamp", False), ("the blue jacket", False), ("the bike lock", False),
           ("the coffee grinder", False), ("the cushion", False), ("the backpack", False)),
    "es": (("la lámpara de escritorio", True), ("la chaqueta azul", True),
           ("el candado de bici", False), ("el molinillo de café", False), ("el cojín", False),
           ("la mochila", True)),
    "de": (("die Schreibtischlampe", True), ("die blaue Jacke", True),
           ("das Fahrradschloss", False), ("die Kaffeemühle", True), ("das Kissen", False),
           ("die Wanderhose", True)),
    "fr": (("la lampe de bureau", True), ("la veste bleue", True), ("l'antivol de vélo", False),
           ("le moulin à café", False), ("le coussin", False), ("le sac à dos", False)),
}

_COUNTRY_NAMES: dict[str, dict[str, str]] = {
    "en": {"DE": "Germany", "AT": "Austria", "FR": "France", "ES": "Spain", "IT": "Italy",
           "NL": "the Netherlands"},
    "es": {"DE": "Alemania", "AT": "Austria", "FR": "Francia", "ES": "España", "IT": "Italia",
           "NL": "Países Bajos"},
    "de": {"DE": "Deutschland", "AT": "Österreich", "FR": "Frankreich", "ES": "Spanien",
           "IT": "Italien", "NL": "Niederlande"},
    "fr": {"DE": "Allemagne", "AT": "Autriche", "FR": "France", "ES": "Espagne", "IT": "Italie",
           "NL": "Pays-Bas"},
}

_CITIES = {"DE": ("Berlin", "Hamburg", "München", "Köln", "Leipzig"),
           "AT": ("Wien", "Graz", "Linz", "Salzburg"),
           "FR": ("Paris", "Lyon", "Marseille", "Nantes", "Lille"),
           "ES": ("Madrid", "Barcelona", "Valencia", "Sevilla", "Bilbao"),
           "IT": ("Roma", "Milano", "Torino", "Bologna", "Napoli"),
           "NL": ("Amsterdam", "Utrecht", "Rotterdam", "Leiden")}
_STREETS = {"DE": ("Hauptstraße", "Bahnhofstraße", "Gartenweg", "Lindenallee"),
            "AT": ("Mariahilfer Straße", "Herrengasse", "Landstraße"),
            "FR": ("rue de la Paix", "avenue Victor Hugo", "rue des Lilas", "boulevard Voltaire"),
            "ES": ("Calle Mayor", "Avenida de la Paz", "Calle del Sol", "Paseo del Prado"),
            "IT": ("Via Roma", "Via Garibaldi", "Corso Italia", "Via Dante"),
            "NL": ("Keizersgracht", "Prinsengracht", "Dorpsstraat", "Kerkstraat")}

_CANCEL_PHRASES: dict[str, dict[str, tuple[str, ...]]] = {
    "en": {"ordered_by_mistake": ("I ordered it by mistake", "I clicked buy by accident"),
           "found_cheaper": ("I found it cheaper somewhere else",
                             "another shop has a better price"),
           "too_slow": ("the delivery takes too long", "it will not arrive in time"),
           "changed_mind": ("I changed my mind", "I don't need it anymore")},
    "es": {"ordered_by_mistake": ("lo pedí por error", "lo compré sin querer"),
           "found_cheaper": ("lo encontré más barato en otra tienda",
                             "otra tienda tiene mejor precio"),
           "too_slow": ("la entrega tarda demasiado", "no va a llegar a tiempo"),
           "changed_mind": ("cambié de opinión", "ya no lo necesito")},
    "de": {"ordered_by_mistake": ("ich habe aus Versehen bestellt",
                                  "das war eine Fehlbestellung"),
           "found_cheaper": ("ich habe es woanders günstiger gefunden",
                             "ein anderer Shop ist billiger"),
           "too_slow": ("die Lieferung dauert zu lange", "es kommt nicht rechtzeitig an"),
           "changed_mind": ("ich habe es mir anders überlegt", "ich brauche es nicht mehr")},
    "fr": {"ordered_by_mistake": ("j'ai commandé par erreur", "c'était une erreur de clic"),
           "found_cheaper": ("je l'ai trouvé moins cher ailleurs",
                             "un autre site est moins cher"),
           "too_slow": ("la livraison prend trop de temps", "ça n'arrivera pas à temps"),
           "changed_mind": ("j'ai changé d'avis", "je n'en ai plus besoin")},
}

# What went wrong, for a refund: clauses around ``{item}`` (``{o}``/``{e}``: agreement).
_REFUND_PHRASES: dict[str, dict[str, tuple[str, ...]]] = {
    "en": {"damaged": ("{item} arrived broken", "{item} came damaged"),
           "wrong_item": ("you sent the wrong item instead of {item}",
                          "I got something else instead of {item}"),
           "missing_parts": ("{item} is missing parts", "some parts of {item} are missing"),
           "late_delivery": ("{item} arrived two weeks late",
                             "{item} came long after the promised date")},
    "es": {"damaged": ("{item} llegó rot{o}", "{item} llegó dañad{o}"),
           "wrong_item": ("me enviaron otra cosa en lugar de {item}",
                          "recibí un artículo equivocado y no {item}"),
           "missing_parts": ("{item} vino sin algunas piezas", "{item} está incomplet{o}"),
           "late_delivery": ("{item} llegó con dos semanas de retraso",
                             "{item} llegó mucho después de la fecha prometida")},
    "de": {"damaged": ("{item} kam beschädigt an", "{item} ist kaputt angekommen"),
           "wrong_item": ("ich habe einen falschen Artikel bekommen, nicht {item}",
                          "statt {item} kam etwas anderes"),
           "missing_parts": ("{item} ist unvollständig", "an {item} fehlen Teile"),
           "late_delivery": ("{item} kam zwei Wochen zu spät",
                             "{item} kam lange nach dem versprochenen Termin")},
    "fr": {"damaged": ("{item} est arrivé{e} cassé{e}", "{item} est arrivé{e} abîmé{e}"),
           "wrong_item": ("j'ai reçu un mauvais article, pas {item}",
                          "vous m'avez envoyé autre chose que {item}"),
           "missing_parts": ("il manque des pièces pour {item}",
                             "{item} est arrivé{e} avec des pièces en moins"),
           "late_delivery": ("{item} est arrivé{e} avec deux semaines de retard",
                             "{item} est arrivé{e} bien après la date promise")},
}

_NAMES = ("Maria", "James", "Aiko", "Lukas", "Priya", "Tom", "Sofia", "Omar", "Elena", "Daniel",
          "Chen", "Fatima", "Noah", "Grace", "Mateo", "Hannah", "Ivan", "Leila", "Jonas", "Clara")
_METHODS_ACCEPTED = ("Visa", "Mastercard", "PayPal", "Klarna")
_METHODS_REFUSED = ("Bitcoin", "American Express", "Apple Pay", "Diners Club")

# ---------------------------------------------------------------------------------------------
# Frames: split -> language -> intent -> templates. Intents are the tool names and the no-tool
# topics. ``{Reason}``/``{Problem}`` are the phrases with a capital first letter.

_TRAIN: dict[str, dict[str, tuple[str, ...]]] = {
    "en": {
        "get_order_status": ("Where is my order {order}?", "What's the status of order {order}?",
                             "Can you check on order {order} for me?",
                             "Has order {order} shipped yet?", "Any update on my order #{order}?"),
        "cancel_order": ("Please cancel order {order}, {reason}.",
                         "I want to cancel my order {order} because {reason}.",
                         "Can you cancel #{order}? {Reason}.", "Cancel order {order}: {reason}."),
        "update_shipping_address": ("Please ship order {order} to {address} instead.",
                                    "New delivery address for order {order}: {address}.",
                                    "I moved. Can you send {order} to {address}?",
                                    "Change the shipping address of #{order} to {address}."),
        "issue_refund": ("Order {order}: {problem}. Please refund {amount}.",
                         "{Problem} (order {order}). I'd like a refund of {amount}.",
                         "I want my {amount} back for order {order}, {problem}.",
                         "Can I get a refund of {amount} for #{order}? {Problem}."),
        "returns": ("Can I still return {item}? I got it {days} days ago.",
                    "I received {item} {days} days ago. Is a return still possible?",
                    "Is it too late to send back {item} after {days} days?"),
        "shipping": ("Do I pay shipping on an order of {amount}?",
                     "Is delivery free for {amount}?",
                     "How much is shipping if my cart is {amount}?"),
        "payment": ("Do you accept {method}?", "Can I pay with {method}?",
                    "Is {method} an option at checkout?"),
        "greeting": ("Hi, this is {name}.", "Hello! My name is {name}.",
                     "Good morning, {name} here."),
        "thanks": ("Thanks, that's all I needed. {name}", "Great, thank you! - {name}",
                   "Perfect, thanks a lot. {name}"),
    },
    "es": {
        "get_order_status": ("¿Dónde está mi pedido {order}?",
                             "¿Cuál es el estado del pedido {order}?",
                             "¿Ya se envió el pedido #{order}?"),
        "cancel_order": ("Por favor, cancela el pedido {order}, {reason}.",
                         "Quiero cancelar mi pedido {order} porque {reason}.",
                         "Cancela el pedido #{order}: {reason}."),
        "update_shipping_address": ("Por favor, envía el pedido {order} a {address}.",
                                    "Nueva dirección de entrega para el pedido {order}: {address}.",
                                    "Me mudé. ¿Puedes mandar el pedido #{order} a {address}?"),
        "issue_refund": ("Pedido {order}: {problem}. Quiero un reembolso de {amount}.",
                         "{Problem} (pedido {order}). Por favor, devuélveme {amount}.",
                         "¿Me reembolsas {amount} del pedido #{order}? {Problem}."),
        "returns": ("¿Todavía puedo devolver {item}? Me llegó hace {days} días.",
                    "Recibí {item} hace {days} días. ¿Aún se puede devolver?"),
        "shipping": ("¿Pago envío en un pedido de {amount}?", "¿El envío es gratis para {amount}?"),
        "payment": ("¿Aceptan {method}?", "¿Puedo pagar con {method}?"),
        "greeting": ("Hola, soy {name}.", "Buenos días, me llamo {name}."),
        "thanks": ("Gracias, eso es todo. {name}", "¡Perfecto, muchas gracias! {name}"),
    },
    "de": {
        "get_order_status": ("Wo ist meine Bestellung {order}?",
                             "Wie ist der Status der Bestellung {order}?",
                             "Wurde Bestellung #{order} schon verschickt?"),
        "cancel_order": ("Bitte stornieren Sie die Bestellung {order}, {reason}.",
                         "Ich möchte meine Bestellung {order} stornieren, denn {reason}.",
                         "Stornieren Sie #{order}: {reason}."),
        "update_shipping_address": ("Bitte liefern Sie die Bestellung {order} an {address}.",
                                    "Neue Lieferadresse für Bestellung {order}: {address}.",
                                    "Ich bin umgezogen. Können Sie #{order} an {address} "
                                    "schicken?"),
        "issue_refund": ("Bestellung {order}: {problem}. Bitte erstatten Sie {amount}.",
                         "{Problem} (Bestellung {order}). Ich möchte {amount} zurück.",
                         "Können Sie mir {amount} für #{order} erstatten? {Problem}."),
        "returns": ("Kann ich {item} noch zurückschicken? Die Lieferung kam vor {days} Tagen.",
                    "Vor {days} Tagen erhalten: Kann ich {item} noch zurückgeben?"),
        "shipping": ("Zahle ich Versand bei einer Bestellung von {amount}?",
                     "Ist der Versand bei {amount} kostenlos?"),
        "payment": ("Akzeptieren Sie {method}?", "Kann ich mit {method} bezahlen?"),
        "greeting": ("Hallo, hier ist {name}.", "Guten Tag, mein Name ist {name}."),
        "thanks": ("Danke, das war alles. {name}", "Super, vielen Dank! {name}"),
    },
    "fr": {
        "get_order_status": ("Où en est ma commande {order} ?",
                             "Quel est le statut de la commande {order} ?",
                             "La commande #{order} est-elle déjà partie ?"),
        "cancel_order": ("Merci d'annuler la commande {order}, {reason}.",
                         "Je veux annuler ma commande {order} car {reason}.",
                         "Annulez la commande #{order} : {reason}."),
        "update_shipping_address": ("Merci d'envoyer la commande {order} à {address}.",
                                    "Nouvelle adresse de livraison pour la commande {order} : "
                                    "{address}.",
                                    "J'ai déménagé. Pouvez-vous livrer #{order} à {address} ?"),
        "issue_refund": ("Commande {order} : {problem}. Merci de rembourser {amount}.",
                         "{Problem} (commande {order}). Je voudrais un remboursement de {amount}.",
                         "Pouvez-vous me rembourser {amount} pour #{order} ? {Problem}."),
        "returns": ("Puis-je encore retourner {item} ? Le colis est arrivé il y a {days} jours.",
                    "Colis reçu il y a {days} jours : est-ce que je peux renvoyer {item} ?"),
        "shipping": ("Dois-je payer la livraison pour une commande de {amount} ?",
                     "La livraison est-elle gratuite pour {amount} ?"),
        "payment": ("Acceptez-vous {method} ?", "Puis-je payer avec {method} ?"),
        "greeting": ("Bonjour, c'est {name}.", "Bonsoir, je m'appelle {name}."),
        "thanks": ("Merci, c'est tout. {name}", "Parfait, merci beaucoup ! {name}"),
    },
}

_HELDOUT: dict[str, dict[str, tuple[str, ...]]] = {
    "en": {
        "get_order_status": ("I'm still waiting for #{order}. Where is it right now?",
                             "Track order number {order}, please.", "When will {order} arrive?"),
        "cancel_order": ("{Reason}, so I no longer want order {order}.",
                         "Stop order {order} from shipping please, {reason}.",
                         "Order {order} needs to be called off. {Reason}."),
        "update_shipping_address": ("Could order {order} go to {address} rather than my old "
                                    "place?",
                                    "Deliver #{order} to this address please: {address}",
                                    "Wrong address on {order}! It should be {address}."),
        "issue_refund": ("{Problem}. Refund {amount} on order {order}, thanks.",
                         "Hello, about #{order}: {problem}, so please return {amount} to my card.",
                         "Please credit {amount} back for order {order} since {problem}."),
        "returns": ("The package with {item} came {days} days ago; may I still return it?",
                    "Is sending {item} back possible? It has been {days} days."),
        "shipping": ("My basket comes to {amount}. Will there be a delivery fee?",
                     "Shipping costs for a {amount} purchase?"),
        "payment": ("Does your shop take {method}?", "I'd like to use {method} to pay. Possible?"),
        "greeting": ("Hey there, {name} speaking.", "Hi support, it's {name}."),
        "thanks": ("Cheers for the help! {name}", "That solved it, many thanks. {name}"),
    },
    "es": {
        "get_order_status": ("Quiero saber cuándo llega el pedido {order}.",
                             "¿Me puedes rastrear el pedido número {order}?"),
        "cancel_order": ("{Reason}, así que ya no quiero el pedido {order}.",
                         "Anula el pedido {order}, por favor; {reason}."),
        "update_shipping_address": ("El pedido {order} debe ir a esta dirección: {address}",
                                    "Cambia la dirección del pedido {order}, la correcta es "
                                    "{address}."),
        "issue_refund": ("{Problem}; reembolsa {amount} en el pedido {order}, gracias.",
                         "Sobre el pedido {order}: {problem}, así que devuelve {amount} a mi "
                         "tarjeta."),
        "returns": ("Hace {days} días que tengo {item}, ¿se puede devolver todavía?",),
        "shipping": ("Mi carrito suma {amount}. ¿Hay gastos de envío?",),
        "payment": ("¿Se puede usar {method} para pagar en su tienda?",),
        "greeting": ("Qué tal, aquí {name}.",),
        "thanks": ("Mil gracias por la ayuda. {name}",),
    },
    "de": {
        "get_order_status": ("Wann kommt die Bestellung {order} bei mir an?",
                             "Bitte verfolgen Sie Bestellnummer {order}."),
        "cancel_order": ("{Reason}, also bitte Bestellung {order} streichen.",
                         "Die Bestellung {order} bitte zurückziehen; {reason}."),
        "update_shipping_address": ("Die Bestellung {order} soll an folgende Adresse gehen: "
                                    "{address}",
                                    "Falsche Adresse bei {order}, richtig ist {address}."),
        "issue_refund": ("{Problem}; bitte {amount} für die Bestellung {order} gutschreiben.",
                         "Zur Bestellung {order}: {problem}, deshalb bitte {amount} "
                         "zurücküberweisen."),
        "returns": ("Rücksendung: {item}, geliefert vor {days} Tagen. Geht das noch?",),
        "shipping": ("Mein Warenkorb liegt bei {amount}. Fallen Versandkosten an?",),
        "payment": ("Nehmen Sie auch {method}?",),
        "greeting": ("Servus, {name} am Apparat.",),
        "thanks": ("Herzlichen Dank für die Hilfe. {name}",),
    },
    "fr": {
        "get_order_status": ("Quand vais-je recevoir la commande {order} ?",
                             "Pouvez-vous suivre la commande numéro {order} ?"),
        "cancel_order": ("{Reason}, donc je ne veux plus la commande {order}.",
                         "Pouvez-vous stopper la commande {order} ? {Reason}."),
        "update_shipping_address": ("La commande {order} doit partir à cette adresse : "
                                    "{address}",
                                    "Mauvaise adresse sur {order}, la bonne est {address}."),
        "issue_refund": ("{Problem} ; remboursez {amount} sur la commande {order}, merci.",
                         "Concernant la commande {order} : {problem}, donc rendez-moi {amount} "
                         "sur ma carte."),
        "returns": ("Ça fait {days} jours que j'ai {item}, un retour est-il encore possible ?",),
        "shipping": ("Mon panier fait {amount}. Y a-t-il des frais de port ?",),
        "payment": ("Est-ce que {method} est accepté chez vous ?",),
        "greeting": ("Salut, ici {name}.",),
        "thanks": ("Un grand merci pour votre aide. {name}",),
    },
}

TEMPLATES: dict[str, dict[str, dict[str, tuple[str, ...]]]] = {"train": _TRAIN,
                                                                "heldout": _HELDOUT}
"""split (``train``/``heldout``) -> language -> intent (tool name or topic) -> frames."""

# ---------------------------------------------------------------------------------------------
# Answers: text replies, by language.

_STATUS_ANSWERS = {
    "en": {"processing": "Order {order} is being prepared and should arrive on {date}.",
           "shipped": "Order {order} has shipped and should arrive on {date}.",
           "delivered": "Order {order} was delivered on {date}."},
    "es": {"processing": "El pedido {order} se está preparando y debería llegar el {date}.",
           "shipped": "El pedido {order} ya se envió y debería llegar el {date}.",
           "delivered": "El pedido {order} se entregó el {date}."},
    "de": {"processing": "Die Bestellung {order} wird vorbereitet und sollte am {date} "
                         "ankommen.",
           "shipped": "Die Bestellung {order} ist unterwegs und sollte am {date} ankommen.",
           "delivered": "Die Bestellung {order} wurde am {date} zugestellt."},
    "fr": {"processing": "La commande {order} est en préparation et devrait arriver le {date}.",
           "shipped": "La commande {order} a été expédiée et devrait arriver le {date}.",
           "delivered": "La commande {order} a été livrée le {date}."},
}
_RESULT_ANSWERS = {
    "en": {"cancel_order": "Order {order} is cancelled; you will not be charged.",
           "update_shipping_address": "Done: order {order} will be delivered to {street}, "
                                      "{city}.",
           "issue_refund": "Your refund of {amount} for order {order} is approved "
                           "(reference {refund_id})."},
    "es": {"cancel_order": "El pedido {order} está cancelado; no se te cobrará nada.",
           "update_shipping_address": "Listo: el pedido {order} se entregará en {street}, "
                                      "{city}.",
           "issue_refund": "Tu reembolso de {amount} del pedido {order} está aprobado "
                           "(referencia {refund_id})."},
    "de": {"cancel_order": "Die Bestellung {order} ist storniert; Ihnen wird nichts berechnet.",
           "update_shipping_address": "Erledigt: Die Bestellung {order} wird an {street}, "
                                      "{city} geliefert.",
           "issue_refund": "Ihre Erstattung von {amount} für die Bestellung {order} ist "
                           "genehmigt (Referenz {refund_id})."},
    "fr": {"cancel_order": "La commande {order} est annulée ; vous ne serez pas débité.",
           "update_shipping_address": "C'est fait : la commande {order} sera livrée à "
                                      "l'adresse {street}, {city}.",
           "issue_refund": "Votre remboursement de {amount} pour la commande {order} est "
                           "approuvé (référence {refund_id})."},
}
_TOPIC_ANSWERS = {
    "en": {"returns_yes": "Yes, you can still return {item}: returns are accepted within 30 "
                          "days of delivery.",
           "returns_no": "Unfortunately {item} can no longer be returned: returns are accepted "
                         "within 30 days of delivery, and it has been {days} days.",
           "shipping_free": "Yes: shipping is free on orders of {free} or more, so {amount} "
                            "ships free.",
           "shipping_paid": "Shipping is free from {free}; an order of {amount} pays {fee} for "
                            "delivery.",
           "payment_yes": "Yes, you can pay with {method}.",
           "payment_no": "No, we do not accept {method}; you can pay with Visa, Mastercard, "
                         "PayPal or Klarna.",
           "greeting": "Hello {name}! How can I help you with your order?",
           "thanks": "You're welcome, {name}! Have a nice day."},
    "es": {"returns_yes": "Sí, todavía puedes devolver {item}: aceptamos devoluciones hasta 30 "
                          "días después de la entrega.",
           "returns_no": "Lamentablemente ya no es posible devolver {item}: aceptamos "
                         "devoluciones hasta 30 días después de la entrega y han pasado {days} "
                         "días.",
           "shipping_free": "Sí: el envío es gratis a partir de {free}, así que un pedido de "
                            "{amount} no paga envío.",
           "shipping_paid": "El envío es gratis a partir de {free}; un pedido de {amount} paga "
                            "{fee} de envío.",
           "payment_yes": "Sí, puedes pagar con {method}.",
           "payment_no": "No aceptamos {method}; puedes pagar con Visa, Mastercard, PayPal o "
                         "Klarna.",
           "greeting": "¡Hola, {name}! ¿En qué puedo ayudarte con tu pedido?",
           "thanks": "¡De nada, {name}! Que tengas un buen día."},
    "de": {"returns_yes": "Ja, Sie können {item} noch zurückschicken: Rücksendungen sind bis "
                          "30 Tage nach der Lieferung möglich.",
           "returns_no": "Leider kann {item} nicht mehr zurückgeschickt werden: Rücksendungen "
                         "sind bis 30 Tage nach der Lieferung möglich, und es sind {days} Tage "
                         "vergangen.",
           "shipping_free": "Ja: Ab {free} ist der Versand kostenlos, also zahlen Sie bei "
                            "{amount} keinen Versand.",
           "shipping_paid": "Der Versand ist ab {free} kostenlos; bei einer Bestellung von "
                            "{amount} kostet er {fee}.",
           "payment_yes": "Ja, Sie können mit {method} bezahlen.",
           "payment_no": "Nein, {method} akzeptieren wir nicht; Sie können mit Visa, "
                         "Mastercard, PayPal oder Klarna bezahlen.",
           "greeting": "Hallo {name}! Wie kann ich Ihnen bei Ihrer Bestellung helfen?",
           "thanks": "Gern geschehen, {name}! Einen schönen Tag noch."},
    "fr": {"returns_yes": "Oui, vous pouvez encore retourner {item} : les retours sont "
                          "acceptés jusqu'à 30 jours après la livraison.",
           "returns_no": "Malheureusement, {item} ne peut plus être retourné{e} : les retours "
                         "sont acceptés jusqu'à 30 jours après la livraison, et {days} jours se "
                         "sont écoulés.",
           "shipping_free": "Oui : la livraison est gratuite dès {free}, donc une commande de "
                            "{amount} est livrée gratuitement.",
           "shipping_paid": "La livraison est gratuite dès {free} ; pour une commande de "
                            "{amount}, elle coûte {fee}.",
           "payment_yes": "Oui, vous pouvez payer avec {method}.",
           "payment_no": "Non, nous n'acceptons pas {method} ; vous pouvez payer avec Visa, "
                         "Mastercard, PayPal ou Klarna.",
           "greeting": "Bonjour {name} ! Comment puis-je vous aider avec votre commande ?",
           "thanks": "Avec plaisir, {name} ! Bonne journée."},
}

FREE_SHIPPING_FROM = 50
SHIPPING_FEE_CENTS = 490
RETURN_DAYS = 30

# ---------------------------------------------------------------------------------------------








def _money(cents: int, lang: str) -> str:
    euros, rest = divmod(cents, 100)
    if lang == "en":
        return f"€{euros}.{rest:02d}"
    return f"{euros},{rest:02d} €"


def _amount(cents: int) -> int | float:
    """The JSON number of ``cents`` euros: whole euros as an integer."""
    return cents // 100 if cents % 100 == 0 else cents / 100


def _draw_cents(rng: random.Random, lo: int, hi: int) -> int:
    return rng.randrange(lo, hi) * 100 + choice(rng, (0, 0, 50, 90, 95, 99))


def _date(rng: random.Random) -> str:
    return f"2025-{rng.randrange(1, 13):02d}-{rng.randrange(1, 29):02d}"


def _postal(rng: random.Random, country: str) -> str:
    if country == "NL":
        letters = "ABCDEFGHJKLMNPRSTVWXZ"
        return f"{rng.randrange(1000, 10000)} {choice(rng, tuple(letters))}" \
               f"{choice(rng, tuple(letters))}"
    if country == "AT":
        return str(rng.randrange(1010, 9999))
    return f"{rng.randrange(1000, 99999):05d}"


def _address(rng: random.Random, lang: str) -> tuple[dict[str, str], str]:
    """An address argument and how the user writes it."""
    country = choice(rng, COUNTRIES)
    number = rng.randrange(1, 140)
    street_name = choice(rng, _STREETS[country])
    street = f"{number} {street_name}" if country == "FR" else f"{street_name} {number}"
    city = choice(rng, _CITIES[country])
    postal = _postal(rng, country)
    args = {"street": street, "city": city, "postal_code": postal, "country": country}
    return args, f"{street}, {postal} {city}, {_COUNTRY_NAMES[lang][country]}"


def _order_id(rng: random.Random) -> str:
    return str(rng.randrange(100000, 1000000))


def _tool_request(rng: random.Random, lang: str, tool: str, frames: tuple[str, ...]
                  ) -> tuple[str, str, dict[str, Any], dict[str, Any]]:
    """(frame, user text, arguments, slot values) of one request for ``tool``."""
    order = _order_id(rng)
    slots: dict[str, Any] = {"order": order}
    args: dict[str, Any] = {"order_id": order}
    if tool == "cancel_order":
        reason = choice(rng, CANCEL_REASONS)
        phrase = choice(rng, _CANCEL_PHRASES[lang][reason])
        slots.update(reason=phrase, Reason=capitalized(phrase))
        args["reason"] = reason
    elif tool == "update_shipping_address":
        address, text = _address(rng, lang)
        slots.update(address=text, street=address["street"], city=address["city"])
        args["address"] = address
    elif tool == "issue_refund":
        reason = choice(rng, REFUND_REASONS)
        item, fem = choice(rng, _ITEMS[lang])
        problem = choice(rng, _REFUND_PHRASES[lang][reason]).format(
            item=item, o="a" if fem else "o", e="e" if fem else "")
        cents = _draw_cents(rng, 5, 180)
        slots.update(problem=problem, Problem=capitalized(problem), amount=_money(cents, lang))
        args.update(amount=_amount(cents), reason=reason)
    frame = choice(rng, frames)
    return frame, capitalized(frame.format(**slots)), args, slots


def _topic_request(rng: random.Random, lang: str, topic: str, frames: tuple[str, ...]
                   ) -> tuple[str, str, str]:
    """(frame, user text, reference answer) of one request that needs no tool."""
    answers = _TOPIC_ANSWERS[lang]
    slots: dict[str, Any]
    if topic == "returns":
        item, fem = choice(rng, _ITEMS[lang])
        days = rng.randrange(2, 60)
        slots = {"item": item, "days": days, "e": "e" if fem else ""}
        answer = answers["returns_yes" if days <= RETURN_DAYS else "returns_no"]
    elif topic == "shipping":
        cents = _draw_cents(rng, 10, 120)
        slots = {"amount": _money(cents, lang), "free": _money(FREE_SHIPPING_FROM * 100, lang),
                 "fee": _money(SHIPPING_FEE_CENTS, lang)}
        answer = answers["shipping_free" if cents >= FREE_SHIPPING_FROM * 100
                         else "shipping_paid"]
    elif topic == "payment":
        accepted = rng.random() < 0.5
        slots = {"method": choice(rng, _METHODS_ACCEPTED if accepted else _METHODS_REFUSED)}
        answer = answers["payment_yes" if accepted else "payment_no"]
    else:
        slots = {"name": choice(rng, _NAMES)}
        answer = answers[topic]
    frame = choice(rng, frames)
    return frame, capitalized(frame.format(**slots)), capitalized(answer.format(**slots))


def _tool_result(rng: random.Random, lang: str, tool: str, args: dict[str, Any],
                 slots: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """(tool result, the final answer that reports it) of a call."""
    order = args["order_id"]
    if tool == "get_order_status":
        status = choice(rng, ("processing", "shipped", "delivered"))
        date = _date(rng)
        result = {"order_id": order, "status": status, "date": date}
        answer = _STATUS_ANSWERS[lang][status].format(order=order, date=date)
    elif tool == "cancel_order":
        result = {"order_id": order, "status": "cancelled"}
        answer = _RESULT_ANSWERS[lang][tool].format(order=order)
    elif tool == "update_shipping_address":
        result = {"order_id": order, "status": "address_updated"}
        answer = _RESULT_ANSWERS[lang][tool].format(order=order, street=slots["street"],
                                                    city=slots["city"])
    else:
        refund_id = f"RF-{rng.randrange(10000, 100000)}"
        result = {"order_id": order, "refund_id": refund_id, "status": "approved",
                  "amount": args["amount"]}
        answer = _RESULT_ANSWERS[lang][tool].format(order=order, amount=slots["amount"],
                                                    refund_id=refund_id)
    return result, answer


def _args_json(args: dict[str, Any]) -> str:
    return json.dumps(args, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def _call_id(*parts: Any) -> str:
    return "call_" + hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()[:20]


def _check_n(n: Any) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"n: must be an integer >= 0, got {n!r}")


def generate_conversations(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` training conversations: ``{"messages"`` (OpenAI format, ending with the reference
    assistant turn), ``"kind"`` (call/result/none), ``"language"``, ``"intent"`` (tool name or
    topic), ``"template"`` (the frame of the user turn)``}``. Every request declares ``TOOLS``."""
    _check_n(n)
    rng = random.Random(seed)
    kinds = schedule(rng, n, KIND_SHARES)
    languages = schedule(rng, n, LANGUAGE_SHARES)
    out = []
    for i, (kind, lang) in enumerate(zip(kinds, languages, strict=True)):
        system: dict[str, Any] = {"role": "system", "content": SYSTEM_PROMPT}
        messages: list[dict[str, Any]]
        if kind == "none":
            topic = choice(rng, TOPICS)
            frame, text, answer = _topic_request(rng, lang, topic, _TRAIN[lang][topic])
            messages = [system, {"role": "user", "content": text},
                        {"role": "assistant", "content": answer}]
            intent = topic
        else:
            intent = choice(rng, TOOL_NAMES)
            frame, text, args, slots = _tool_request(rng, lang, intent, _TRAIN[lang][intent])
            call_id = _call_id(seed, i, intent)
            call: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "type": "function",
                 "function": {"name": intent, "arguments": _args_json(args)}}]}
            messages = [system, {"role": "user", "content": text}, call]
            if kind == "result":
                result, answer = _tool_result(rng, lang, intent, args, slots)
                messages += [{"role": "tool", "tool_call_id": call_id,
                              "content": _args_json(result)},
                             {"role": "assistant", "content": answer}]
        out.append({"messages": messages, "kind": kind, "language": lang, "intent": intent,
                    "template": frame})
    return out


def generate_records(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` logged calls as OpenAI ``{"request": chat.completions body, "response": completion}``
    records, each request declaring ``TOOLS``: upload them as a JSONL file with
    ``factory ingest FILE --tag project=agent-orders``, or send ``request`` through the gateway."""
    records = []
    for i, conv in enumerate(generate_conversations(n, seed)):
        *prompt, reply = conv["messages"]
        request = {"model": REFERENCE_MODEL, "messages": prompt, "tools": TOOLS,
                   "temperature": 0}
        message: dict[str, Any] = {"role": "assistant", "content": reply["content"]}
        if reply.get("tool_calls"):
            message["tool_calls"] = reply["tool_calls"]
            completion_text = reply["tool_calls"][0]["function"]["arguments"]
        else:
            completion_text = reply["content"]
        digest = hashlib.sha256(f"{seed}:{i}:{completion_text}".encode()).hexdigest()[:24]
        prompt_chars = sum(len(m["content"] or "") for m in prompt) + len(json.dumps(TOOLS))
        usage = {"prompt_tokens": prompt_chars // 4 + 8,
                 "completion_tokens": len(completion_text) // 3 + 1}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        response = {
            "id": f"chatcmpl-{digest}", "object": "chat.completion",
            "created": 1_760_000_000 + i, "model": REFERENCE_MODEL,
            "choices": [{"index": 0, "message": message,
                         "finish_reason": "tool_calls" if reply.get("tool_calls") else "stop"}],
            "usage": usage,
        }
        records.append({"request": request, "response": response})
    return records


def generate_heldout(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` held-out requests phrased with ``TEMPLATES["heldout"]`` frames only: ``{"messages"``
    (system + user, OpenAI format), ``"expected"`` (``{"name", "arguments"}``, or
    ``{"name": None, "arguments": None}`` when no tool should be called), ``"kind"``
    (call/none), ``"language"``, ``"intent"``, ``"template"``, ``"reference"`` (the text answer
    of a no-tool request, else None)``}``. Send ``messages`` with ``tools=TOOLS``."""
    _check_n(n)
    rng = random.Random(seed)
    kinds = schedule(rng, n, HELDOUT_KIND_SHARES)
    languages = schedule(rng, n, LANGUAGE_SHARES)
    out = []
    for kind, lang in zip(kinds, languages, strict=True):
        reference = None
        if kind == "none":
            intent = choice(rng, TOPICS)
            frame, text, reference = _topic_request(rng, lang, intent, _HELDOUT[lang][intent])
            expected: dict[str, Any] = {"name": None, "arguments": None}
        else:
            intent = choice(rng, TOOL_NAMES)
            frame, text, args, _ = _tool_request(rng, lang, intent, _HELDOUT[lang][intent])
            expected = {"name": intent, "arguments": args}
        out.append({"messages": [{"role": "system", "content": SYSTEM_PROMPT},
                                 {"role": "user", "content": text}],
                    "expected": expected, "kind": kind, "language": lang, "intent": intent,
                    "template": frame, "reference": reference})
    return out


def template_pattern(frame: str) -> re.Pattern[str]:
    """A regex that matches exactly the texts ``frame`` can produce (any slot values)."""
    parts = re.split(r"\{[A-Za-z]+\}", frame)
    body = "(.+)".join(re.escape(p) for p in parts)
    # The first letter is capitalized after filling (a frame may start with a lower-case slot).
    return re.compile(body, re.DOTALL | (re.IGNORECASE if not parts[0] else 0))


def _get(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, Mapping) else getattr(obj, key, None)


def exact_tool_call(expected: Mapping[str, Any], message: Any) -> bool:
    """Whether the assistant ``message`` (an OpenAI SDK message or its dict) does exactly what
    ``expected`` (``{"name", "arguments"}``) says: no tool call when ``name`` is None, else one
    call of ``name`` whose arguments, parsed as JSON, equal ``arguments``."""
    calls = _get(message, "tool_calls") or []
    if expected["name"] is None:
        return not calls
    if len(calls) != 1:
        return False
    fn = _get(calls[0], "function")
    if fn is None or _get(fn, "name") != expected["name"]:
        return False
    raw = _get(fn, "arguments")
    try:
        args = json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError:
        return False
    return json_equal(args, expected["arguments"])
