"""The admin's operator actions: each one of :mod:`lease_celery.ops` (the CLI's and the web
dashboard's), so it records the same history entry, behind a Django permission.

An action that needs input (a reason, a result, a limit) shows a form first; each selected
row is then acted on in turn, and each outcome (done, or refused and why) is a message.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from django import forms
from django.conf import settings
from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils.module_loading import import_string

from ...checks import encode_result
from ...errors import LeaseError
from ...ops import Done, Operations, Refusal
from ...stores.registry import shared_store

__all__ = ["LimitForm", "NoForm", "ReasonForm", "ResultForm", "operations", "run_action",
           "store_url"]

#: The most rows one action acts on (each is one conditional write and one history entry).
MOST_ROWS = 500


def store_url() -> str:
    """The store the admin reads and acts on: ``settings.LEASE_CELERY_STORE_URL``, by
    default ``django://default``."""
    return str(getattr(settings, "LEASE_CELERY_STORE_URL", "django://default"))


def celery_app() -> Any:
    """The Celery app that publishes a requeued key's task and the waiters a raised limit
    lets run: ``settings.LEASE_CELERY_APP`` (``"proj.celery:app"``). Without it nothing is
    published from the admin; the workers' sweeper re-publishes (ops says which)."""
    path = getattr(settings, "LEASE_CELERY_APP", None)
    if not path:
        return None
    return import_string(str(path).replace(":", "."))


def operations(request: HttpRequest) -> Operations:
    user = getattr(request, "user", None)
    name = user.get_username() if user is not None else "someone"
    return Operations(shared_store(store_url()), actor=f"{name} via the Django admin",
                      app=celery_app())


class ReasonForm(forms.Form):
    reason = forms.CharField(max_length=500, required=False,
                             help_text="recorded in the key's history")


class ResultForm(forms.Form):
    result = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 3}),
                             help_text="what replays return: JSON, or text; empty is null")

    def clean_result(self) -> Any:
        text = self.cleaned_data["result"]
        if not text.strip():
            return None
        try:
            value = json.loads(text)
            encode_result(value)
        except (ValueError, LeaseError):
            return text
        return value


class LimitForm(forms.Form):
    concurrency = forms.CharField(required=False, help_text=(
        "leases of the group at once: a number; 0 lifts the limit; empty keeps it"))
    rate = forms.CharField(required=False, help_text=(
        "starts per period in Celery's format (10/m); 0 lifts it; empty keeps it"))
    reset = forms.BooleanField(required=False, help_text="back to the tasks' own limits")

    def clean_concurrency(self) -> int | bool | None:
        text = self.cleaned_data["concurrency"].strip()
        if not text:
            return None
        try:
            value = int(text)
        except ValueError:
            raise forms.ValidationError("a whole number") from None
        if value < 0:
            raise forms.ValidationError("0 or more")
        return False if value == 0 else value

    def clean_rate(self) -> str | bool | None:
        text = self.cleaned_data["rate"].strip()
        return None if not text else (False if text == "0" else text)


#: What an action does to one row with the form's data.
Perform = Callable[[Operations, str, dict[str, Any]], Done]


def run_action(modeladmin: Any, request: HttpRequest, queryset: Any, *, action: str,
               title: str, form_class: type[forms.Form], perform: Perform,
               said: Callable[[Done], str]) -> HttpResponse | None:
    """The form (first call), then ``perform`` on each selected row (the form posted back):
    None sends the admin back to the list, where the messages are shown."""
    if request.POST.get("apply") == "yes":
        form = form_class(request.POST)
        if form.is_valid():
            ops = operations(request)
            for pk in queryset.values_list("pk", flat=True)[:MOST_ROWS]:
                try:
                    done = perform(ops, pk, form.cleaned_data)
                except Refusal as exc:
                    modeladmin.message_user(request, f"{pk}: {exc}", messages.WARNING)
                    continue
                text = said(done)
                if done.unrecorded is not None:
                    text += f" (not recorded in the history: {done.unrecorded})"
                modeladmin.message_user(request, text, messages.SUCCESS)
            return None
    else:
        form = form_class()
    context = {**modeladmin.admin_site.each_context(request), "title": title, "form": form,
               "queryset": queryset, "action": action, "opts": modeladmin.opts,
               "select_across": request.POST.get("select_across", "0"), "most": MOST_ROWS}
    return TemplateResponse(request, "admin/lease_celery/action_form.html", context)


class NoForm(forms.Form):
    """An action that asks for nothing but a confirmation."""
